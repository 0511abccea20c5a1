// `lvx init-model`: a random checkpoint with a release's exact tensor names, shapes and file
// layout (models/release_init.h), so that every job runs at the sizes users run without a
// download: configs/models/releases/*/config.json, or any config.json of the three families.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "models/release_init.h"
#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/common/files.h"

namespace {

using lvx::models::ReleaseInitOptions;
using lvx::models::ReleasePlan;

at::ScalarType parse_dtype(const std::string& s, const nlohmann::json& config) {
  std::string d = s;
  if (d == "auto") {  // the config's torch_dtype (text_config's for nested configs), else bf16
    const std::string t = config.value("torch_dtype", "");
    d = t == "float32" ? "fp32" : t == "float16" ? "fp16" : "bf16";
  }
  if (d == "bf16") return at::kBFloat16;
  if (d == "fp32") return at::kFloat;
  if (d == "fp16") return at::kHalf;
  LVX_FAIL("--dtype: expected bf16, fp16, fp32 or auto, got '", s, "'");
}

std::string gb(uint64_t bytes) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.2f GB", static_cast<double>(bytes) / 1e9);
  return b;
}

// What the plan holds, for people (and with --json for scripts).
nlohmann::json summary(const ReleasePlan& plan, const ReleaseInitOptions& o) {
  const auto& family = lvx::models::family_of_config(plan.config, "config.json");
  int64_t loaded = 0;
  for (const auto& [name, shape] : family.parameter_shapes(plan.config, "config.json")) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    loaded += n;
  }
  return {{"model_type", family.model_type()},
          {"tensors", plan.layout.tensors.size()},
          {"parameters", plan.parameters},
          {"parameters_loaded", loaded},
          {"bytes", plan.bytes},
          {"dtype", plan.config["torch_dtype"]}};
}

int cmd_init_model(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx init-model --config RELEASE/config.json --out DIR [--dtype bf16] [--layers N] "
      "[--vision-layers N] [--vocab N]",
      "Write a random checkpoint with a release's exact tensor names, shapes and layout (sharded\n"
      "safetensors with model.safetensors.index.json, config.json, tokenizer.json), tensor by\n"
      "tensor: memory stays small whatever the model's size. The releases' configs are in\n"
      "configs/models/releases/ (mPLUG-Owl3 1B/2B/7B, OpenFlamingo 3B/4B/9B,\n"
      "Llama-3.2-11B-Vision). --layers, --vision-layers and --vocab make a smaller model of the\n"
      "same widths (the first N decoder layers, with the release's cross layers among them).");
  p.add_option("config", 'c', "", "a release's config.json (or its directory)", true);
  p.add_option("out", 'o', "", "output checkpoint directory (written whole, then renamed)", true);
  p.add_option("dtype", 0, "auto", "bf16 | fp16 | fp32 | auto (the config's torch_dtype)");
  p.add_option("layers", 0, "0", "decoder layers to keep (0: all)");
  p.add_option("vision-layers", 0, "0", "vision encoder layers to keep (0: all)");
  p.add_option("cross-layers", 0, "",
               "with --layers: the cross layers, 0-based (default: the release's below --layers)");
  p.add_option("vocab", 0, "0", "vocabulary size (0: the release's)");
  p.add_option("seed", 0, "0", "random seed (the same seed writes the same bytes)");
  p.add_option("max-shard-bytes", 0, "5000000000",
               "largest shard file (save_pretrained's max_shard_size \"5GB\")");
  p.add_flag("force", 0, "replace --out if it exists (once the new checkpoint is complete)");
  p.add_flag("dry-run", 0, "print what would be written, write nothing");
  p.add_flag("json", 0, "print the summary as one JSON line");
  p.add_flag("list", 0, "with --dry-run: every tensor's name and shape (JSON with --json)");
  p.add_flag("quiet", 'q', "no progress lines");
  if (!p.parse(argc, argv)) return 0;
  std::string cfg_path = p.get("config");
  if (std::filesystem::is_directory(cfg_path)) cfg_path += "/config.json";
  const nlohmann::json config = lvx::read_json_file(cfg_path, "model config", uint64_t{16} << 20);
  ReleaseInitOptions o;
  o.dtype = parse_dtype(p.get("dtype"), config);
  o.resize.layers = p.get_int("layers", 0, lvx::models::kMaxConfigLayers);
  o.resize.vision_layers = p.get_int("vision-layers", 0, lvx::models::kMaxConfigLayers);
  o.resize.vocab = p.get_int("vocab", 0, lvx::models::kMaxConfigVocab);
  if (!p.get("cross-layers").empty()) o.resize.cross_layers = p.get_int_list("cross-layers");
  o.seed = static_cast<uint64_t>(p.get_int("seed", 0, INT64_MAX));
  o.max_shard_bytes = static_cast<uint64_t>(p.get_int("max-shard-bytes", 1, INT64_MAX));
  o.force = p.flag("force");
  const ReleasePlan plan = lvx::models::plan_release(config, o, cfg_path);
  nlohmann::json s = summary(plan, o);
  if (p.flag("dry-run")) {
    if (p.flag("list")) {
      s["tensors"] = nlohmann::json::object();
      for (const auto& [name, shape] : plan.layout.tensors) s["tensors"][name] = shape;
    }
    std::cout << (p.flag("json") ? s.dump() : s.dump(2)) << "\n";
    return 0;
  }
  const bool quiet = p.flag("quiet");
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t shown = 0;
  o.progress = [&](const std::string&, uint64_t done, uint64_t total) {
    if (quiet || (done - shown < uint64_t{1} << 30 && done < total)) return;
    shown = done;
    std::cerr << "lvx init-model: " << gb(done) << " of " << gb(total) << "\n";
  };
  const int shards = lvx::models::write_release_model(p.get("out"), plan, o);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s["shards"] = shards;
  s["seconds"] = secs;
  s["out"] = p.get("out");
  if (p.flag("json")) {
    std::cout << s.dump() << "\n";
  } else {
    std::cout << "lvx init-model: " << s["model_type"].get<std::string>() << ", "
              << plan.parameters << " parameters (" << s["parameters_loaded"].get<int64_t>()
              << " of them run by lvx), " << gb(plan.bytes) << " "
              << s["dtype"].get<std::string>() << " in " << shards << " shard"
              << (shards > 1 ? "s" : "") << " -> " << p.get("out") << " ("
              << static_cast<int>(secs + 0.5) << " s)\n";
  }
  return 0;
}

}  // namespace

LVX_COMMAND("init-model",
            "write a random checkpoint with a release's exact tensor names, shapes and layout",
            cmd_init_model);
