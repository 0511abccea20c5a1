// `lvx merge-adapter`: a LoRA adapter (PEFT's layout, models/lora.h) merged into a checkpoint's
// weights, written as a Hugging Face checkpoint directory that lvx and transformers load.
#include <filesystem>
#include <iostream>

#include "models/checkpoint.h"
#include "models/lora.h"
#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/runtime/train_checkpoint.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"

namespace {

namespace fs = std::filesystem;

bool is_weights_file(const std::string& n) {
  return (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) ||
         n == "model.safetensors.index.json" || n == "manifest.json";
}

int cmd_merge_adapter(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx merge-adapter --model DIR --adapter DIR --output DIR",
      "Merges a LoRA adapter (adapter_config.json + adapter_model.safetensors, as PEFT and\n"
      "lvx finetune's lora: section write them) into the model's weights: W + s*B*A for each\n"
      "adapted weight (computed in fp32, stored in the checkpoint's dtype), every other tensor\n"
      "as it is. The output is a checkpoint directory in the model's layout (same shard count),\n"
      "its other files (config.json, tokenizer.json, ...) copied.");
  p.add_option("model", 'm', "", "base checkpoint directory", true);
  p.add_option("adapter", 'a', "", "LoRA adapter directory (PEFT's layout)", true);
  p.add_option("output", 'o', "", "new checkpoint directory (must not exist, or be empty)", true);
  if (!p.parse(argc, argv)) return 0;
  // Run folders mean their latest checkpoints (a LoRA run's adapter, a full run's model).
  const std::string model = lvx::runtime::follow_run_folder(p.get("model"));
  const std::string adapter = lvx::runtime::follow_run_folder(p.get("adapter")), out = p.get("output");
  std::error_code ec;
  LVX_CHECK(!fs::exists(out, ec) || (fs::is_directory(out, ec) && fs::is_empty(out, ec)),
            "--output: ", out, " already exists and is not an empty directory (nothing is ",
            "overwritten)");
  lvx::models::Checkpoint ck = lvx::models::load_checkpoint(model);
  const lvx::models::LoraAdapter ad = lvx::models::load_lora(adapter, ck.tensors);
  lvx::models::merge_lora(ck.tensors, ad);
  int shards = 0;
  for (const auto& e : fs::directory_iterator(model))
    if (e.path().extension() == ".safetensors") ++shards;
  lvx::models::save_checkpoint(out, ck.config, ck.tensors, std::max(1, shards));
  for (const auto& e : fs::directory_iterator(model)) {
    const std::string n = e.path().filename().string();
    if (e.is_regular_file() && !is_weights_file(n))
      fs::copy_file(e.path(), fs::path(out) / n, fs::copy_options::overwrite_existing);
  }
  std::cout << "merged " << ad.layers.size() << " LoRA weights (" << ad.parameters()
            << " adapter parameters) of " << adapter << " into " << out << "\n";
  return 0;
}

}  // namespace

LVX_COMMAND("merge-adapter", "merge a LoRA adapter (PEFT's layout) into a checkpoint's weights",
            cmd_merge_adapter);
