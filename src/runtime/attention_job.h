// One distributed attention call driven from files: what `lvx attention` runs on every rank.
// Inputs in global token order (q [B,Sq,Hq,D], k/v [B,Skv,Hkv,D], optional do, q_media [B,Sq] and
// kv_media [B,Skv] int32, −1 = none); the job shards them as the strategy needs, runs forward
// (and backward), writes each rank's shard to <output>.parts/, and rank 0 assembles
// o [B,Sq,Hq,D], lse [B,Hq,Sq] fp32 (−inf for rows that see no key) and dq/dk/dv, written
// atomically, plus a stats JSON {"strategy", "ranks": [{"rank","bytes_sent","bytes_received",
// "seconds"}...]}.
#pragma once

#include <string>

#include "src/attention/strategy.h"

namespace lvx::runtime {

struct AttentionJob {
  std::string strategy = "lv_xattn";
  std::string input, output, stats;  // stats: optional JSON path
  std::string mask = "none";         // none | causal | media_immediate | media_upto
  bool backward = false;
  double scale = 0;                  // 0: 1/sqrt(D)
  int repeat = 1;                    // timed repetitions (the median is reported)
};

// Reads the input file's tensors and checks names, shapes and dtypes; returns the spec.
attention::AttentionSpec validate_attention_input(const AttentionJob& job);

// Runs on this rank (rendezvous from the environment). Returns 0 on success.
int run_attention_rank(const AttentionJob& job);

kernels::MaskKind mask_kind_from_name(const std::string& name, kernels::MediaRule* rule);

}  // namespace lvx::runtime
