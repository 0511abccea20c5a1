// Question-answering benchmark: time to first token (video decode + prefill) and decode tokens/s
// of `lvx qa` on a tiny random mPLUG-Owl3 (models/init.h) as the frames grow, at several rank
// counts, with the planner's per-layer choice against LV-XAttn (cross) + ring (self), ring-only and
// all-gather-only prefills. Decoding is pass-Q whatever the prefill ran (models/decode.h).
// Correctness first: at each (frames, ranks) every strategy must give the same greedy tokens as
// the planner's run; the ratios are measured side by side in one run.
//   bench_qa [--frames 64,256,1024,4096] [--nproc 1,2,4] [--tokens 16] [-o md|json]
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "models/init.h"
#include "src/cli/args.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "video/encoder.h"

using namespace lvx;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string run(const std::string& cmd) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  LVX_CHECK(f, "cannot run ", cmd);
  char buf[1 << 16];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  LVX_CHECK(pclose(f) == 0, "failed: ", cmd, "\n", out);
  return out;
}

// A video of `frames` random 32×32 frames (every frame differs, so every frame costs a decode).
void make_video(const std::string& path, int64_t frames) {
  video::VideoWriter w(path, 32, 32, 16);
  at::manual_seed(0);
  for (int64_t i = 0; i < frames; ++i)
    w.write(at::randint(0, 256, {32, 32, 3}, at::kByte), /*keyframe=*/i % 16 == 0);
  w.close();
}

}  // namespace

int main(int argc, char** argv) {
  cli::ArgParser p("bench_qa [options]",
                   "lvx qa time to first token and tokens/s: planner vs ring vs all_gather.");
  p.add_option("frames", 'f', "64,256,1024,4096", "frame counts (16 visual tokens each)");
  p.add_option("nproc", 'n', "1,2,4", "rank counts");
  p.add_option("tokens", 't', "16", "tokens generated per question");
  p.add_option("workdir", 'w', "", "scratch folder (default: a temporary one)");
  p.add_option("output", 'o', "md", "md | json");
  try {
    if (!p.parse(argc, argv)) return 0;
    const std::vector<int64_t> frames = p.get_int_list("frames"), nprocs = p.get_int_list("nproc");
    fs::path dir = p.get("workdir").empty() ? fs::temp_directory_path() / "lvx_bench_qa"
                                            : fs::path(p.get("workdir"));
    fs::create_directories(dir);
    const std::string model = (dir / "model").string(), clip = (dir / "long.mp4").string();
    int64_t most = 0;
    for (int64_t f : frames) most = std::max(most, f);
    models::TinyModelSpec spec;
    spec.words = {"What", "happens"};
    models::write_tiny_mplug_owl3(model, spec);
    make_video(clip, most);
    const std::string lvx =
        (fs::path(dist::self_executable()).parent_path().parent_path() / "lvx").string();
    const std::string cluster = std::string(LVX_SOURCE_DIR) + "/configs/clusters/h100_80g_16.yaml";
    const std::vector<std::pair<std::string, std::string>> strategies = {
        {"planner", "--strategies auto --cluster " + cluster},
        {"lv_xattn", "--strategies lv_xattn,ring"},
        {"ring", "--strategies ring"},
        {"all_gather", "--strategies all_gather"}};
    json rows = json::array();
    if (p.get("output") == "md")
      std::cout << "| frames | ranks | strategy | TTFT s | tokens/s | TTFT vs planner | tokens/s "
                   "vs planner | prefill MB sent | decode B/token |\n|---|---|---|---|---|---|---|"
                   "---|---|\n";
    for (int64_t f : frames)
      for (int64_t n : nprocs) {
        json base;
        for (const auto& [name, flags] : strategies) {
          const json r = json::parse(run(
              lvx + " qa --model " + model + " --video " + clip + " --question 'What happens?' " +
              "--num-frames " + std::to_string(f) + " --nproc " + std::to_string(n) + " " + flags +
              " --max-new-tokens " + p.get("tokens") + " --ignore-stop --json 2>/dev/null"));
          if (name == "planner") base = r;
          // Correctness first: the same greedy tokens whatever the prefill's strategies.
          LVX_CHECK(r["response"] == base["response"], name, " at ", f, " frames, ", n,
                    " ranks answered ", r["response"].dump(), ", the planner's plan ",
                    base["response"].dump());
          const double ttft = r["timings"]["ttft_s"], per = r["timings"]["decode_per_token_s"];
          const double base_ttft = base["timings"]["ttft_s"];
          const double base_per = base["timings"]["decode_per_token_s"];
          json row = {{"frames", f},
                      {"ranks", n},
                      {"strategy", name},
                      {"ttft_s", ttft},
                      {"tokens_per_s", 1.0 / per},
                      {"ttft_vs_planner", ttft / base_ttft},
                      {"tokens_per_s_vs_planner", base_per / per},
                      {"prefill_bytes", r["bytes"]["prefill"]},
                      {"decode_bytes_per_token", r["bytes"]["decode_per_token"]},
                      {"plan", r["plan"]}};
          rows.push_back(row);
          if (p.get("output") == "md") {
            char line[512];
            std::snprintf(line, sizeof(line),
                          "| %lld | %lld | %s | %.3f | %.1f | %.2f | %.2f | %.2f | %lld |\n",
                          static_cast<long long>(f), static_cast<long long>(n), name.c_str(), ttft,
                          1.0 / per, ttft / base_ttft, base_per / per,
                          r["bytes"]["prefill"].get<double>() / 1e6,
                          static_cast<long long>(r["bytes"]["decode_per_token"].get<int64_t>()));
            std::cout << line << std::flush;
          }
        }
      }
    if (p.get("output") == "json") std::cout << rows.dump(2) << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "bench_qa: error: " << e.what() << "\n";
    return 1;
  }
}
