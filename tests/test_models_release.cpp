// Release-shaped random checkpoints (models/release_init.h, lvx init-model):
//   - every release config's tensors, by name and shape, are the reference packages' own modules
//     built on the meta device (transformers' Mllama, Qwen2 and SigLIP, open_flamingo's
//     Flamingo: tests/reference/param_count_ref.py names), and what lvx runs of them is what
//     `lvx plan` counts;
//   - the writer's files: shards within the bound, an index naming every tensor and the total,
//     the same bytes for the same seed whatever the sharding, the documented fills, a tokenizer
//     with the family's special tokens below the embedding's rows, a checkpoint load_model takes;
//   - refusals that name the problem and leave no half-written directory.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "models/checkpoint.h"
#include "models/model.h"
#include "models/release_init.h"
#include "models/tokenizer/tokenizer.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
#include "tests/build_paths.h"
#include "tests/model_conformance.h"

namespace lvx::models {
namespace {

namespace fs = std::filesystem;
using lvx::testing::run_command;
using lvx::testing::workdir;

const std::vector<std::string> kReleases = {
    "llama32_vision_11b", "mplug_owl3_1b",   "mplug_owl3_2b",  "mplug_owl3_7b",
    "openflamingo_3b",    "openflamingo_4b", "openflamingo_9b"};

std::string release_config(const std::string& name) {
  return lvx::testing::source_dir() + "/configs/models/releases/" + name + "/config.json";
}

nlohmann::json read_config(const std::string& name) {
  return read_json_file(release_config(name), "config");
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// "parameters: N (...)" of `lvx plan`'s output.
int64_t planned_parameters(const std::string& out) {
  const size_t at = out.find("parameters: ");
  return at == std::string::npos ? -1 : std::stoll(out.substr(at + 12));
}

TEST(ReleaseInit, EveryReleaseHoldsTheReferencePackagesTensors) {
  std::string cmd = lvx::testing::configured_python() + " " + lvx::testing::source_dir() +
                    "/tests/reference/param_count_ref.py names";
  for (const std::string& name : kReleases) cmd += " " + release_config(name);
  std::istringstream lines(run_command(cmd));
  std::vector<nlohmann::json> refs;
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("{\"tensors\"", 0) == 0) refs.push_back(nlohmann::json::parse(line)["tensors"]);
  ASSERT_EQ(refs.size(), kReleases.size()) << "the reference printed " << refs.size() << " layouts";
  for (size_t i = 0; i < kReleases.size(); ++i) {
    SCOPED_TRACE(kReleases[i]);
    const nlohmann::json config = read_config(kReleases[i]);
    const ReleasePlan plan = plan_release(config, ReleaseInitOptions{}, release_config(kReleases[i]));
    const nlohmann::json& ref = refs[i];
    EXPECT_EQ(plan.layout.tensors.size(), ref.size());
    int64_t total = 0;
    for (const auto& [n, shape] : ref.items()) {
      const auto it = plan.layout.tensors.find(n);
      EXPECT_TRUE(it != plan.layout.tensors.end()) << "lvx init-model does not write " << n;
      if (it != plan.layout.tensors.end()) {
        EXPECT_EQ(it->second, shape.get<std::vector<int64_t>>()) << n;
      }
      total += numel(shape.get<std::vector<int64_t>>());
    }
    for (const auto& [n, shape] : plan.layout.tensors)
      EXPECT_TRUE(ref.contains(n)) << "the release has no tensor " << n;
    EXPECT_EQ(plan.parameters, total);
    EXPECT_EQ(plan.bytes, static_cast<uint64_t>(2 * total));  // bf16, as released
    // What lvx runs of them (the family's shapes: the rest is never computed) is what the planner
    // sizes: `lvx plan --model <release folder>`, from config.json alone.
    int64_t loaded = 0;
    for (const auto& [n, shape] : family_of_config(config, "config").parameter_shapes(config, "c"))
      loaded += numel(shape);
    const std::string out = run_command(
        lvx::testing::binary_dir() + "/lvx plan --model " +
        fs::path(release_config(kReleases[i])).parent_path().string() + " --cluster " +
        lvx::testing::source_dir() + "/configs/clusters/h100_80g_16.yaml --train --frames 8 " +
        "--text 64 --nproc 8");
    EXPECT_EQ(planned_parameters(out), loaded) << out;
  }
}

// A small mPLUG-Owl3 of the 1B's layout (the writer is the same at every size).
nlohmann::json small_config() {
  nlohmann::json c = read_config("mplug_owl3_1b");
  c["hidden_size"] = 64;
  c["intermediate_size"] = 96;
  c["num_attention_heads"] = 4;
  c["num_key_value_heads"] = 2;
  c["num_hidden_layers"] = 3;
  c["max_window_layers"] = 3;
  c["hyper_layers"] = {2};
  c["vocab_size"] = 1024;
  c["vision_config"] = {{"hidden_size", 32}, {"image_size", 28}, {"intermediate_size", 48},
                        {"model_type", "siglip_vision_model"}, {"num_attention_heads", 2},
                        {"num_hidden_layers", 3}, {"patch_size", 14}};
  return c;
}

StateDict tensors_of(const std::string& dir) { return load_checkpoint(dir).tensors; }

TEST(ReleaseInit, ShardsIndexFillsTokenizerAndSeeds) {
  ReleaseInitOptions o;
  o.dtype = at::kFloat;
  o.seed = 5;
  const ReleasePlan plan = plan_release(small_config(), o, "small");
  o.max_shard_bytes = plan.bytes / 3;
  const std::string a = (workdir() / "release_a").string(), b = (workdir() / "release_b").string(),
                    c = (workdir() / "release_c").string();
  const int shards = write_release_model(a, plan, o);
  EXPECT_GE(shards, 3);
  // The index names every tensor once, in a shard within the bound, and the total.
  const nlohmann::json index = read_json_file(a + "/model.safetensors.index.json", "index");
  EXPECT_EQ(index["weight_map"].size(), plan.layout.tensors.size());
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), plan.bytes);
  for (const auto& [file, names] : lvx::checkpoint_shards(a))
    EXPECT_LE(fs::file_size(file), o.max_shard_bytes + (uint64_t{1} << 20)) << file;
  // The same seed writes the same tensors whatever the sharding; another seed does not.
  o.max_shard_bytes = uint64_t{1} << 40;
  EXPECT_EQ(write_release_model(b, plan, o), 1);
  o.seed = 6;
  write_release_model(c, plan, o);
  const StateDict ta = tensors_of(a), tb = tensors_of(b), tc = tensors_of(c);
  ASSERT_EQ(ta.size(), plan.layout.tensors.size());
  size_t random = 0;
  for (const auto& [name, t] : ta) {
    EXPECT_TRUE(at::equal(t, tb.at(name))) << name;
    if (t.numel() > 1 && t.std().item<double>() > 0) {  // drawn, not a constant norm or bias
      ++random;
      EXPECT_FALSE(at::equal(t, tc.at(name))) << name << " is the same under another seed";
    }
    EXPECT_EQ(t.sizes(), at::IntArrayRef(plan.layout.tensors.at(name))) << name;
  }
  EXPECT_GT(random, ta.size() / 3);
  // The fills (release_init.h): norms 1, biases 0, gates in [0.3, 1], the rest N(0, 0.02²).
  EXPECT_TRUE(at::all(ta.at("language_model.model.norm.weight") == 1).item<bool>());
  EXPECT_TRUE(at::all(ta.at("vision2text_model.0.bias") == 0).item<bool>());
  const at::Tensor gate = ta.at("language_model.model.layers.1.self_attn.gate");
  EXPECT_TRUE(at::all((gate >= 0.3) & (gate <= 1.0)).item<bool>());
  const double sd = ta.at("language_model.model.embed_tokens.weight").std().item<double>();
  EXPECT_NEAR(sd, 0.02, 0.002);
  // The tokenizer has the family's specials, below the embedding's rows; config.json says fp32.
  const Tokenizer tok = Tokenizer::from_file(a + "/tokenizer.json");
  for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>"}) {
    ASSERT_TRUE(tok.token_to_id(s).has_value()) << s;
    EXPECT_LT(*tok.token_to_id(s), 1024) << s;
  }
  EXPECT_EQ(tok.encode(" video", false, true).size(), 1u);
  EXPECT_EQ(read_json_file(a + "/config.json", "config")["torch_dtype"], "float32");
  // And lvx loads it (every name and shape checked), in bf16 too.
  EXPECT_EQ(load_model(a, at::kFloat)->decoder_layers(), 3);
  EXPECT_EQ(load_model(b, at::kBFloat16)->decoder_layers(), 3);
}

TEST(ReleaseInit, RefusalsNameTheProblemAndLeaveNoHalfWrittenDirectory) {
  const std::string out = (workdir() / "release_refused").string();
  ReleaseInitOptions o;
  o.resize.layers = 1;  // the 1B's first hyper layer is its 7th (1-based)
  std::string err;
  try {
    plan_release(read_config("mplug_owl3_1b"), o, "1b/config.json");
  } catch (const Error& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("hyper_layers"), std::string::npos) << err;
  EXPECT_NE(err.find("--layers 6"), std::string::npos) << err;
  // An existing directory is kept unless forced; the forced write replaces it whole.
  fs::create_directories(out);
  std::ofstream(out + "/mine.txt") << "keep";
  const ReleasePlan plan = plan_release(small_config(), ReleaseInitOptions{}, "small");
  err.clear();
  try {
    write_release_model(out, plan, ReleaseInitOptions{});
  } catch (const Error& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("--force"), std::string::npos) << err;
  EXPECT_TRUE(fs::exists(out + "/mine.txt"));
  ReleaseInitOptions force;
  force.force = true;
  write_release_model(out, plan, force);
  EXPECT_FALSE(fs::exists(out + "/mine.txt"));
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
  for (const auto& e : fs::directory_iterator(workdir()))
    EXPECT_EQ(e.path().filename().string().find(".partial-"), std::string::npos) << e.path();
  // A special token the vocabulary cannot hold is named.
  ReleaseInitOptions tiny_vocab;
  tiny_vocab.resize.vocab = 300;  // the words alone take more ids
  err.clear();
  try {
    write_release_model((workdir() / "release_vocab").string(),
                        plan_release(small_config(), tiny_vocab, "small"), tiny_vocab);
  } catch (const Error& e) {
    err = e.what();
  }
  EXPECT_NE(err.find("embedding rows"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(workdir() / "release_vocab"));
}

// ---- every family at release width, few layers: lvx init-model, load, one forward against the
// reference package (its own model, in float32 where float64 would take minutes) ----

struct WidthCase {
  std::string name, release, init_args, script, batch_args, run_args;
};

// The checkpoint lvx init-model writes and the reference's logits for it, made once per version
// of the generator and of lvx's writer (generated(): the stamp holds both sources and the args).
std::string release_reference(const WidthCase& c, std::string* log) {
  const std::string src = lvx::testing::source_dir();
  std::string stamp = lvx::testing::script_stamp(src + "/tests/reference/" + c.script);
  for (const std::string f : {"models/release_init.cpp", "models/mplug_owl3/release.cpp",
                              "models/mllama/release.cpp", "models/openflamingo/release.cpp"})
    stamp += lvx::testing::read_text(src + "/" + f);
  stamp += "\n" + c.init_args + "\n" + c.batch_args + "\n" + c.run_args;
  return lvx::testing::generated(
      "release_width_" + c.name, stamp,
      [&](const std::string& dir) {
        const std::string py = lvx::testing::python() + " " + src + "/tests/reference/" + c.script;
        std::string out = run_command(lvx::testing::lvx_binary() + " init-model --config " + src +
                                      "/configs/models/releases/" + c.release + " --out " + dir +
                                      "/model --quiet " + c.init_args);
        out += run_command(py + " make-batch " + dir + "/model " + dir + "/batch.safetensors " +
                           c.batch_args);
        out += run_command(py + " run " + dir + "/model " + dir + "/batch.safetensors " + dir +
                           "/expected.safetensors " + c.run_args);
        return out;
      },
      log);
}

void PrintTo(const WidthCase& c, std::ostream* os) { *os << c.name << " " << c.init_args; }

class ReleaseWidth : public ::testing::TestWithParam<WidthCase> {};

TEST_P(ReleaseWidth, InitLoadAndForwardEqualTheReferencePackage) {
  const WidthCase& c = GetParam();
  std::string log;
  const std::string dir = release_reference(c, &log);
  ASSERT_FALSE(dir.empty()) << log;
  const std::string out = (workdir() / ("width_" + c.name + ".safetensors")).string();
  log = run_command(lvx::testing::lvx_binary() + " forward --model " + dir + "/model --input " +
                    dir + "/batch.safetensors --output " + out + " --dtype fp32");
  ASSERT_TRUE(fs::exists(out)) << log;
  const at::Tensor got = load_safetensors(out).tensors.at("logits");
  const at::Tensor want = load_safetensors(dir + "/expected.safetensors").tensors.at("logits");
  ASSERT_EQ(got.sizes(), want.sizes());
  // fp32 against the package (float64, or float32 where stated): the logits' error within 1e-4 of
  // their largest value (measured: ~1e-6 relative).
  const double scale = want.abs().max().item<double>();
  const double err = (got - want).abs().max().item<double>();
  std::cout << c.name << ": logits " << got.sizes() << ", max |lvx − reference| " << err
            << " of max |logit| " << scale << "\n";
  EXPECT_GT(scale, 0);
  EXPECT_LE(err, 1e-4 * scale);
}

// Release widths, cut to the fewest layers that keep a cross layer: mPLUG-Owl3-2B (hidden 1536,
// SigLIP-so400m at 384 px, its hyper layer 0), Llama-3.2-11B-Vision (hidden 4096, 14336 MLP, one
// cross layer; the ViT-H at 560 px with 4 tiles, one local and one global layer) and
// OpenFlamingo-3B (MPT-1B's 2048, a gated block, the ViT-L at 224 px, the 6-layer Perceiver);
// vocabularies cut to 1024.
INSTANTIATE_TEST_SUITE_P(
    Families, ReleaseWidth,
    ::testing::Values(
        WidthCase{"mplug_owl3_2b", "mplug_owl3_2b",
                  "--dtype fp32 --layers 1 --vision-layers 2 --vocab 1024", "mplug_owl3_ref.py",
                  "--batch 1 --length 24 --images-per-sample 1", ""},
        WidthCase{"llama32_vision_11b", "llama32_vision_11b",
                  "--dtype fp32 --layers 1 --cross-layers 0 --vision-layers 1 --vocab 1024",
                  "mllama_ref.py", "--length 24 --one-image", "--float32"},
        WidthCase{"openflamingo_3b", "openflamingo_3b",
                  "--dtype fp32 --layers 1 --vision-layers 1 --vocab 1024", "openflamingo_ref.py",
                  "--batch 1 --length 24 --images 1", "--float32"}),
    [](const ::testing::TestParamInfo<WidthCase>& i) { return i.param.name; });

}  // namespace
}  // namespace lvx::models
