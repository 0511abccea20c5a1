// `lvx forward`: one model step (logits; with --backward also loss and gradients) from files on
// N real ranks: the conformance interface of the model families.
#include <cstdint>
#include <cstdlib>
#include <filesystem>

#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/dist/launcher.h"
#include "src/runtime/device.h"
#include "src/runtime/forward_job.h"
#include "src/runtime/train_checkpoint.h"

namespace {

int cmd_forward(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx forward --model DIR --input batch.safetensors --output out.safetensors [--nproc N]\n"
      "            [--strategies auto|S|S_cross,S_self] [--backward] [--dtype fp32|bf16|auto]\n"
      "            [--device auto|cuda|cpu]",
      "One step of a model from a Hugging Face checkpoint directory on N local ranks (or on the\n"
      "ranks of torchrun / mpirun / lvx launch). Input: input_ids int64 [B,L] (the image token\n"
      "where each image sits), pixel_values float32 [N_img,3,H,W] preprocessed, in prompt order,\n"
      "optional labels int64 [B,L] (-100 = ignore; position t's logits predict labels[t]).\n"
      "Output: logits float32 [B,L,V]; with --backward also loss (mean cross-entropy) and\n"
      "grad.<name> for every trainable parameter (all but the vision encoder). Each rank holds "
      "its\n"
      "text shard and encodes only its own frames. Strategies: auto (the planner, on --cluster;\n"
      "without one lv_xattn for cross and ring for self layers), one strategy S for every layer,\n"
      "or S_cross,S_self; S may be a forward+backward pair such as lv_xattn+ring.");
  p.add_option("model", 'm', "", "checkpoint directory (config.json, model.safetensors)", true);
  p.add_option("adapter", 0, "",
               "LoRA adapter directory (PEFT's layout): W + s*B*A at every step; --backward "
               "gives the gradients of its lora_A/lora_B");
  p.add_option("input", 'i', "", "input safetensors file", true);
  p.add_option("output", 'o', "", "output safetensors file (written atomically)", true);
  lvx::cli::add_nproc_options(p, "1", "local ranks to start");
  lvx::cli::add_threads_option(p);
  p.add_option("strategies", 's', "auto", "auto | S | S_cross,S_self");
  p.add_option("cluster", 'c', "", "cluster config for --strategies auto (lvx calibrate)");
  p.add_option("dtype", 0, "auto", "fp32 | bf16 | auto (the checkpoint's where the device computes it natively: bf16 on a GPU and on CPUs with AMX or AVX512-BF16, else fp32)");
  lvx::cli::add_device_option(p);
  p.add_flag("backward", 'b', "also compute the loss and the gradients");
  p.add_flag("remat", 0,
             "rematerialization-aware checkpointing (DistFlashAttn §3.3): recompute\n"
             "each block's o_proj, norm and MLP in the backward, never the distributed attention");
  p.add_option("repeat", 0, "1", "timed steps (> 1: after one warm-up step; medians in metadata)");
  p.add_flag("print-plan", 0, "print the per-layer strategies (rank 0)");
  p.add_option("generate", 'g', "0",
               "> 0: prefill, then this many greedy tokens through the KV cache with pass-Q\n"
               "decoding; output tokens int64 [B,T] and step_logits float32 [B,T,V] instead");
  p.add_flag("generate-rows", 0,
             "with --generate: each sample its own generation, all stepped together as lvx\n"
             "serve's continuous batching steps them (the same tokens as the batch)");
  p.add_option("max-batch-tokens", 0, "0",
               "with --generate: prefill each prompt's prefix in chunks of at most this many\n"
               "tokens, as lvx serve does (0: whole)");
  lvx::cli::add_chunk_keys_option(p);
  lvx::cli::add_decode_ranks_option(p);
  p.add_flag("recompute", 0,
             "recompute each cross layer's K/V from the shared visual features in the backward\n"
             "(LV-XAttn §3.2): saves x, O and lse per cross layer instead of its K/V");
  if (!p.parse(argc, argv)) return 0;
  lvx::runtime::ForwardJob job;
  // A run folder means its latest checkpoint, resolved once here for every rank.
  job.model = lvx::runtime::follow_run_folder(p.get("model"));
  job.adapter = p.get("adapter").empty() ? "" : lvx::runtime::follow_run_folder(p.get("adapter"));
  job.input = p.get("input");
  job.output = p.get("output");
  job.strategies = p.get("strategies");
  job.cluster = p.get("cluster");
  job.dtype = p.get("dtype");
  job.device = p.get("device");
  job.backward = p.flag("backward");
  job.print_plan = p.flag("print-plan");
  job.recompute_cross_kv = p.flag("recompute");
  job.repeat = static_cast<int>(p.get_int("repeat", 1, 1000000));
  job.remat = p.flag("remat");
  job.generate = p.get_int("generate", 0, INT64_MAX);
  job.generate_rows = p.flag("generate-rows");
  job.prefill_chunk = p.get_int("max-batch-tokens", 0, INT32_MAX);
  job.prefill_chunk_keys = lvx::cli::chunk_keys(p);
  job.lead_decode = lvx::cli::decode_on_lead(p);
  if (lvx::cli::inside_rank()) {
    job.lead_threads = lvx::cli::host_threads(lvx::cli::apply_threads(p));
    return lvx::runtime::run_forward_rank(job);
  }
  const int nproc = lvx::cli::checked_nproc(p);
  lvx::cli::apply_threads(p, nproc);
  lvx::runtime::validate_forward_job(job);  // bad input fails once, clearly, before ranks start
  lvx::runtime::check_local_devices(job.device, nproc);
  return lvx::cli::launch_model_job(argc, argv, nproc, job.model, job.adapter,
                                    /*rank0_direct=*/false);
}

}  // namespace

LVX_COMMAND("forward", "one model step (logits, loss, gradients) from a checkpoint on N ranks",
            cmd_forward);
