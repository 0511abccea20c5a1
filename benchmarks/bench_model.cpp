// Model benchmark: a random mPLUG-Owl3 (240728) of a chosen size, one training step (forward and
// backward) of a long-video QA batch through `lvx forward` on N local ranks, with and without
// LV-XAttn's K/V recomputation (§3.2), for several frame counts. Correctness first: every run's
// logits and loss are compared with the 1-rank run without recomputation on the same batch.
// Reported per run: forward and forward+backward time (slowest rank, median of --reps steps after
// a warm-up), text tokens and frames per second, the share of the step spent blocked on
// attention messages, peak resident memory per rank, and the planner's predicted attention
// memory. The summary fits memory per frame with and without recomputation: how many more frames
// fit in the same memory, at what step-time overhead (the paper: 1.6x the frames at under 8%).
//   bench_model [--frames 32,64,128] [--text 256] [--nproc 1,2] [--hidden 128] [--layers 4]
//               [--reps 2] [-o md|json]
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "models/mplug_owl3/model.h"
#include "src/cli/args.h"
#include "src/common/error.h"
#include "src/common/safetensors.h"
#include "src/dist/launcher.h"
#include "src/planner/planner.h"

using namespace lvx;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kImageToken = 511, kVocab = 512;

// A random checkpoint with the released names and a tokenizer.json that names <|image|>.
void make_model(const fs::path& dir, int64_t hidden, int64_t layers) {
  nlohmann::json cfg = {{"model_type", "mplugowl3"},
                        {"hidden_size", hidden},
                        {"num_hidden_layers", layers},
                        {"num_attention_heads", hidden / 32},
                        {"num_key_value_heads", hidden / 64},
                        {"intermediate_size", 2 * hidden},
                        {"vocab_size", kVocab},
                        {"rope_theta", 1e6},
                        {"rms_norm_eps", 1e-6},
                        {"tie_word_embeddings", false},
                        {"hyper_layers", {1, layers / 2 + 1}},
                        {"vision_config",
                         {{"hidden_size", 64},
                          {"num_hidden_layers", 2},
                          {"num_attention_heads", 2},
                          {"intermediate_size", 128},
                          {"image_size", 32},
                          {"patch_size", 8}}}};
  const auto c = models::mplug_owl3_config(cfg, dir.string(), /*gated=*/true, kImageToken);
  at::manual_seed(0);
  models::StateDict w;
  for (const auto& [name, shape] : models::mplug_owl3_shapes(c)) {
    at::Tensor t = at::randn(shape);
    if (shape.size() == 2) t /= std::sqrt(static_cast<double>(shape[1]));
    if (name.find("norm") != std::string::npos) t = at::ones(shape);
    w[name] = t;
  }
  models::save_checkpoint(dir.string(), cfg, w);
  // A placeholder vocabulary (the benchmark feeds token ids, never text) and <|image|> after it.
  nlohmann::json vocab = nlohmann::json::object();
  for (int64_t i = 0; i < kImageToken; ++i) vocab["tok" + std::to_string(i)] = i;
  std::ofstream(dir / "tokenizer.json") << nlohmann::json{
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens",
       {{{"id", kImageToken},
         {"content", "<|image|>"},
         {"single_word", false},
         {"lstrip", false},
         {"rstrip", false},
         {"normalized", false},
         {"special", true}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", nullptr},
      {"post_processor", nullptr},
      {"decoder", nullptr},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", nlohmann::json::array()}}}}.dump();
}

// Video QA: a short prefix, one <|image|> per frame, then the question and answer (labels on the
// last quarter).
void make_batch(const fs::path& path, int64_t frames, int64_t text) {
  LVX_CHECK(text >= frames + 8, "--text (", text, ") must exceed the frames (", frames,
            ") by 8 or more: a prefix, one token per frame, the question");
  at::manual_seed(1);
  at::Tensor ids = at::randint(0, kImageToken, {1, text}, at::kLong);
  ids.narrow(1, 4, frames).fill_(kImageToken);
  at::Tensor labels = at::full({1, text}, -100, at::kLong);
  const int64_t answer = text / 4;
  labels.narrow(1, text - answer, answer)
      .copy_(at::randint(0, kImageToken, {1, answer}, at::kLong));
  save_safetensors(
      path.string(),
      {{"input_ids", ids}, {"pixel_values", at::randn({frames, 3, 32, 32})}, {"labels", labels}});
}

std::map<std::string, std::string> metadata(const std::string& path) {
  return load_safetensors(path, {"logits"}).metadata;
}

struct Mode {
  const char* name;
  const char* flags;
};
// Without saving memory; LV-XAttn's K/V recomputation; DistFlashAttn's rematerialization-aware
// checkpointing; both.
constexpr Mode kModes[] = {{"none", ""},
                           {"recompute", " --recompute"},
                           {"remat", " --remat"},
                           {"both", " --recompute --remat"}};

struct Run {
  int64_t frames, nproc;
  std::string mode;
  double fwd, bwd, wait, rss, live, err, predicted;
};

// bench_model's options (defaults in --help).
void add_options(cli::ArgParser& p) {
  p.add_option("frames", 'f', "32,64,128", "frame counts (16 visual tokens each)");
  p.add_option("text", 't', "512", "text tokens, including one <|image|> per frame");
  p.add_option("nproc", 'n', "1,2", "rank counts");
  p.add_option("hidden", 0, "256", "LM width (heads of 32)");
  p.add_option("layers", 0, "4", "LM layers (two are hyper layers)");
  p.add_option("reps", 'r', "2", "timed steps per run (after one warm-up)");
  p.add_option("output-format", 'o', "md", "md | json");
}

// The planner's cluster, for memory only: a device large enough for everything.
planner::ClusterConfig memory_only_cluster() {
  planner::ClusterConfig cluster;
  cluster.name = "cpu";
  cluster.gpus_per_node = 64;
  cluster.nodes = 1;
  cluster.device_memory_bytes = int64_t{1} << 50;
  cluster.attention["fp32"] = {1e10, 1e10};
  cluster.gemm_flops["fp32"] = 1e10;
  cluster.intra_node = cluster.inter_node = {1e9, 1e-5};
  return cluster;
}

// What every run shares: the work folder, `lvx forward`'s binary, the model, the planner's
// cluster and the options.
struct Setup {
  fs::path dir;
  std::string lvx;
  const models::MplugOwl3& model;
  planner::ClusterConfig cluster;
  const cli::ArgParser& p;
};

// One `lvx forward` training step of `batch` on `nproc` ranks with `mode`'s flags; returns its
// output file. Fails with the run's log when the run fails.
std::string forward_step(const Setup& s, const std::string& batch, int64_t nproc,
                         const Mode& mode) {
  const std::string out = (s.dir / "out.safetensors").string();
  const std::string log = (s.dir / "log.txt").string();
  const std::string cmd = s.lvx + " forward --model " + (s.dir / "model").string() + " --input " +
                          batch + " --output " + out + " --nproc " + std::to_string(nproc) +
                          " --strategies lv_xattn,ring --backward --repeat " + s.p.get("reps") +
                          mode.flags + " > " + log + " 2>&1";
  if (std::system(cmd.c_str()) != 0) {
    std::ifstream f(log);
    LVX_FAIL("bench_model: ", cmd, " failed:\n",
             std::string(std::istreambuf_iterator<char>(f), {}));
  }
  return out;
}

// The largest difference of `out`'s logits and loss from the frame count's first run; the first
// run (`reference` empty) becomes the reference, with 0. Fails above 1e-3.
double error_vs_reference(const Setup& s, const std::string& out, int64_t frames, int64_t nproc,
                          const Mode& mode, std::string& reference) {
  auto t = load_safetensors(out).tensors;
  double err = 0;
  if (reference.empty()) {
    reference = (s.dir / ("ref" + std::to_string(frames) + ".safetensors")).string();
    fs::copy_file(out, reference, fs::copy_options::overwrite_existing);
  } else {
    auto ref = load_safetensors(reference).tensors;
    err = std::max((t.at("logits") - ref.at("logits")).abs().max().item<double>(),
                   std::abs(t.at("loss").item<double>() - ref.at("loss").item<double>()));
    LVX_CHECK(err < 1e-3, "bench_model: ", nproc, " ranks (", mode.name, ") differ from 1 rank by ",
              err);
  }
  return err;
}

// The planner's peak memory for the run's training step (K/V recomputation on or off).
double predicted_bytes(const Setup& s, int64_t frames, int64_t nproc, bool recompute) {
  planner::Workload w;
  w.frames = frames;
  w.text_tokens = s.p.get_int("text");
  w.tokens_per_frame = s.model.config().vision.tokens();
  w.ranks = nproc;
  w.dtype = "fp32";
  w.train = true;
  planner::ModelConfig pm = s.model.planner_model();
  pm.dtype = "fp32";
  planner::CostOptions opt;
  opt.recompute_cross_kv = recompute;
  return planner::plan(pm, s.cluster, w, opt).peak_mem_bytes;
}

// One configuration: the step run, checked against the reference, its measurements read back
// and the planner's prediction beside them.
Run run_mode(const Setup& s, const std::string& batch, int64_t frames, int64_t nproc,
             const Mode& mode, std::string& reference) {
  const bool recompute = std::string(mode.flags).find("recompute") != std::string::npos;
  const std::string out = forward_step(s, batch, nproc, mode);
  auto m = metadata(out);
  const double err = error_vs_reference(s, out, frames, nproc, mode, reference);
  const double predicted = predicted_bytes(s, frames, nproc, recompute);
  return {frames,
          nproc,
          mode.name,
          std::stod(m.at("forward_seconds")),
          std::stod(m.at("backward_seconds")),
          std::stod(m.at("comm_wait_seconds")),
          std::stod(m.at("peak_rss_bytes")),
          std::stod(m.at("live_bytes_after_forward")),
          err,
          predicted};
}

// Every frame count x rank count x mode, each frame count's batch made first; the first run of
// a frame count is the others' reference.
std::vector<Run> run_all(const Setup& s) {
  std::vector<Run> runs;
  for (int64_t frames : s.p.get_int_list("frames")) {
    const std::string batch =
        (s.dir / ("batch" + std::to_string(frames) + ".safetensors")).string();
    make_batch(batch, frames, s.p.get_int("text"));
    std::string reference;
    for (int64_t nproc : s.p.get_int_list("nproc"))
      for (const Mode& mode : kModes)
        runs.push_back(run_mode(s, batch, frames, nproc, mode, reference));
  }
  return runs;
}

// The runs as a JSON array.
void print_json(const std::vector<Run>& runs) {
  nlohmann::json j = nlohmann::json::array();
  for (const Run& r : runs)
    j.push_back({{"frames", r.frames},
                 {"nproc", r.nproc},
                 {"saving", r.mode},
                 {"forward_s", r.fwd},
                 {"step_s", r.fwd + r.bwd},
                 {"comm_wait_s", r.wait},
                 {"peak_rss_bytes", r.rss},
                 {"live_bytes_after_forward", r.live},
                 {"predicted_attention_bytes", r.predicted},
                 {"max_err_vs_1_rank", r.err}});
  std::cout << j.dump(2) << "\n";
}

// The runs as a Markdown table; rates over `text` tokens.
void print_table(const std::vector<Run>& runs, int64_t text) {
  std::printf(
      "| frames | ranks | saving | fwd s | fwd+bwd s | text tok/s fwd | tok/s fwd+bwd "
      "| frames/s fwd+bwd | comm wait | peak RSS MiB | held after fwd MiB | planner MiB "
      "| err vs 1 rank |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Run& r : runs)
    std::printf(
        "| %lld | %lld | %s | %.3f | %.3f | %.0f | %.0f | %.1f | %.0f%% | %.1f | %.1f | "
        "%.2f | %.1e |\n",
        static_cast<long long>(r.frames), static_cast<long long>(r.nproc), r.mode.c_str(), r.fwd,
        r.fwd + r.bwd, text / r.fwd, text / (r.fwd + r.bwd), r.frames / (r.fwd + r.bwd),
        100 * r.wait / (r.fwd + r.bwd), r.rss / (1 << 20), r.live / (1 << 20),
        r.predicted / (1 << 20), r.err);
}

// The run of `f` frames on `nproc` ranks with saving `mode`; the first run when there is none.
Run find_run(const std::vector<Run>& runs, int64_t f, int64_t nproc, const std::string& mode) {
  for (const Run& r : runs)
    if (r.frames == f && r.nproc == nproc && r.mode == mode) return r;
  return runs.front();
}

// Memory held per frame (slope between the smallest and largest frame count) and step time
// at the largest, for each saving against none, per rank count: how many more frames fit in
// the same memory, at what time overhead.
void print_summary(const std::vector<Run>& runs, const std::vector<int64_t>& fl,
                   const std::vector<int64_t>& nprocs) {
  const int64_t f0 = fl.front(), f1 = fl.back();
  for (int64_t nproc : nprocs) {
    if (f1 == f0) break;
    const Run a0 = find_run(runs, f0, nproc, "none"), a1 = find_run(runs, f1, nproc, "none");
    const double base = (a1.live - a0.live) / static_cast<double>(f1 - f0);
    const double pred_base = (a1.predicted - a0.predicted) / static_cast<double>(f1 - f0);
    std::printf(
        "\n%lld rank(s): memory held after the forward, per frame: none %.1f KiB (planner "
        "%.1f KiB of attention activations), step %.3f s at %lld frames\n",
        static_cast<long long>(nproc), base / 1024, pred_base / 1024, a1.fwd + a1.bwd,
        static_cast<long long>(f1));
    for (const char* mode : {"recompute", "remat", "both"}) {
      const Run b0 = find_run(runs, f0, nproc, mode), b1 = find_run(runs, f1, nproc, mode);
      const double slope = (b1.live - b0.live) / static_cast<double>(f1 - f0);
      std::printf(
          "  %-9s %.1f KiB per frame (planner %.1f KiB): %.2fx the frames in the same "
          "memory; step %.3f s (%+.1f%%)\n",
          mode, slope / 1024, (b1.predicted - b0.predicted) / (f1 - f0) / 1024,
          slope > 0 ? base / slope : 0.0, b1.fwd + b1.bwd,
          100 * ((b1.fwd + b1.bwd) / (a1.fwd + a1.bwd) - 1));
    }
  }
}

int bench(int argc, char** argv) {
  cli::ArgParser p(
      "bench_model [options]",
      "One mPLUG-Owl3 training step per configuration through `lvx forward`, with and\n"
      "without K/V recomputation; correctness against the 1-rank run first.");
  add_options(p);
  if (!p.parse(argc, argv)) return 0;
  const fs::path dir = fs::temp_directory_path() / ("lvx_bench_model_" + std::to_string(getpid()));
  fs::create_directories(dir);
  make_model(dir / "model", p.get_int("hidden"), p.get_int("layers"));
  models::Checkpoint ck = models::load_checkpoint((dir / "model").string());
  const models::MplugOwl3 model(ck, kImageToken, at::kFloat);
  // `lvx forward` beside this benchmark's folder (build/lvx, build/benchmarks/bench_model).
  const std::string lvx =
      (fs::path(dist::self_executable()).parent_path().parent_path() / "lvx").string();
  const Setup setup{dir, lvx, model, memory_only_cluster(), p};
  const std::vector<Run> runs = run_all(setup);
  const int64_t text = p.get_int("text");
  if (p.get("output-format") == "json") {
    print_json(runs);
  } else {
    print_table(runs, text);
  }
  print_summary(runs, p.get_int_list("frames"), p.get_int_list("nproc"));
  fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return bench(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "bench_model: " << e.what() << "\n";
    return 1;
  }
}
