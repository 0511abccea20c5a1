// One model step driven from files: what `lvx forward` runs on every rank (the conformance
// interface of the models; keep it stable).
//   input:  input_ids int64 [B, L] (the family's image token where each image sits, as the
//           released processors write it), pixel_values float32 [N_img, 3, H, W] preprocessed,
//           images in prompt order; optional labels int64 [B, L] (−100 = ignore; not shifted:
//           position t's logits predict labels[t]).
//   output: logits float32 [B, L, V]; with backward also loss (float32 scalar, mean cross-entropy
//           over labels != −100) and grad.<parameter name> float32 for every trainable parameter.
// Each rank holds its text shard and its own frames (models/parallel.h); rank 0 assembles the
// logits in global order and writes the file atomically. The result is the same at every rank
// count and strategy choice, within the dtype's tolerance. The output's metadata holds the slowest
// rank's median forward_seconds, backward_seconds and comm_wait_seconds (time blocked on
// messages), the largest peak_rss_bytes, bytes_sent and live_bytes_after_forward (heap in use
// between forward and backward: weights and everything saved for the backward) of any rank.
#pragma once

#include <string>

namespace lvx::runtime {

struct ForwardJob {
  std::string model;                // checkpoint directory (Hugging Face layout)
  // A LoRA adapter (PEFT's layout, models/lora.h) applied at every step as W + s·B·A; with
  // backward, the gradients are those of its grad.<module>.lora_A.weight / lora_B.weight.
  std::string adapter;
  std::string input, output;        // safetensors files
  std::string strategies = "auto";  // auto | S | S_cross,S_self (S may be a pair F+B)
  std::string cluster;              // cluster config for auto (empty: the built-in rule)
  std::string dtype = "auto";       // fp32 | bf16 | auto (src/runtime/device.h)
  std::string device = "auto";      // auto | cuda | cpu (src/runtime/device.h)
  bool backward = false;
  bool print_plan = false;
  bool recompute_cross_kv = false;  // LV-XAttn §3.2 (models/recompute.h)
  bool remat = false;               // DistFlashAttn §3.3 checkpointing (models/recompute.h)
  int repeat = 1;                   // timed steps (> 1: one more warm-up step first)
  // > 0: generation instead of one step: prefill, then this many greedy tokens through the KV
  // cache (src/runtime/generate.h). Output tokens int64 [B, T], step_logits float32 [B, T, V]
  // (step t's logits, from which token t was chosen); metadata prefill_seconds,
  // decode_seconds_per_token, prefill_bytes_sent and decode_bytes_sent (rank 0's, per token).
  int64_t generate = 0;
  // With generate: each sample its own generation, all stepped together as lvx serve's
  // continuous batching steps them (runtime/generate.h generate_rows); the same outputs.
  bool generate_rows = false;
  // --generate: decode on rank 0 alone (models/lead_decode.h; --decode-ranks one), with
  // lead_threads intra-op threads there; false: every rank runs every step (all).
  bool lead_decode = true;
  int lead_threads = 0;
  // With generate: GenerateOptions::prefill_chunk (--max-batch-tokens).
  int64_t prefill_chunk = 0;
  int64_t prefill_chunk_keys = 0;  // --max-batch-visual-keys
};

// Runs on this rank (rendezvous from the environment). Returns 0 on success.
int run_forward_rank(const ForwardJob& job);

// Checks the files cheaply before ranks start (errors name the file and the tensor).
void validate_forward_job(const ForwardJob& job);

}  // namespace lvx::runtime
