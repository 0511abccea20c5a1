// Decoding on one rank, with messages only where the visual keys live.
//
// pass-Q decoding (models/decode.h) runs every new token on every rank: each rank reads every
// weight for it, and every layer sends one message, for the prompt's text keys that the prefill
// left sharded. On a host whose ranks share one memory bus that costs twice: n ranks read n times
// the weight bytes of one (decoding is bound by those reads), and 24 messages a token (the 1B's
// layers) cost more than the step itself. Measured on mPLUG-Owl3-1B in bf16, 2 ranks on 2 cores:
// 103 ms a token against 38 ms on 1 rank (docs/real_size.md).
//
// A prompt's text keys are small next to its visual ones (a question against thousands of
// frames' tokens), so lead decoding gathers them once, to rank 0, when decoding starts; then
// rank 0 runs each decode step alone, on the threads of every local rank (Parallel::lead_threads),
// and only the cross-attention layers send anything: rank 0 sends the layer's query
// q [B, Hq, D] to each rank, each computes its partial over its own visual keys and sends it
// back, and rank 0 merges them in rank order as pass-Q merges them (LV-XAttn, "LV-XAttn:
// Distributed Cross-Attention for Long Visual Inputs in Multimodal Large Language Models", §3.1
// at Sq = 1; the merge is BurstAttention's Eq. 3). The visual keys never move; the other ranks
// wait for the next query (serve_visual_partials) and hold no generated keys.
//
// Where it runs: one generation stepped alone (lvx qa, lvx forward --generate, evaluation during
// fine-tuning), Parallel::lead_decode; lvx serve's rows keep pass-Q on every rank (a row's cache
// must stay sharded, as the others' are, for the batched step). Messages per token: a query out
// and a partial back per other rank and cross layer (4 layers for the 1B, against 24
// all-gathers), plus the token's broadcast. Bytes rank 0 sends per cross layer:
// (n−1)·B·Hq·D·dtype; each other rank: B·Hq·(D+1)·4.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "models/decode.h"
#include "models/model.h"
#include "models/parallel.h"

namespace lvx::models {

// Whether decode steps of this generation run on rank 0 alone (several ranks, lead_decode).
bool leads_decode(const Parallel& par);

// Decoding's start under lead decoding, on every rank at once (collective): every rank's shard
// of the prompt's text keys is gathered to rank 0, whose cache then holds the whole prompt's
// (DecodeCache::prompt_whole); padding keys stay masked. Once per cache; a no-op after.
void gather_prompt_to_lead(dist::ProcessGroup& pg, DecodeCache& cache);

// q's partial over the cached prompt keys of `layer`, merged over the ranks: pass-Q (one message),
// or, on a cache that holds the whole prompt, its own call (no message).
Partial prompt_over_ranks(dist::ProcessGroup& pg, const DecodeCache& cache, size_t layer,
                          const at::Tensor& q, double scale);

// q's partial over every rank's visual keys of `vis`, merged over the ranks: pass-Q, or under lead
// decoding rank 0 sends q to each other rank (serve_visual_partials answers with its partial,
// [B, Hq, D + 1] fp32: o, then lse) and merges theirs with its own, computed meanwhile, in rank
// order.
Partial visual_over_ranks(const Parallel& par, const at::Tensor& q, const KVShard& vis,
                          double scale);

// One decode step of `model` under lead decoding, on every rank (collective): rank 0 gathers the
// prompt's keys on the first step and runs the family's decode_step on Parallel::lead_threads,
// returning its logits; the others serve_visual_partials and return an undefined tensor.
at::Tensor lead_decode_step(const Model& model, const at::Tensor& tokens, const Parallel& par,
                            DecodeCache& cache);

// A rank other than 0 under lead decoding, for one decode step of rank 0: receives each call's
// query, answers with its partial over its own visual keys (`calls` in the leader's order), and
// advances the cache's length as the step does.
void serve_visual_partials(const std::vector<CrossCall>& calls, const Parallel& par,
                           DecodeCache& cache);

// Runs `step` with the intra-op threads set to `threads` (> 0; 0: as they are), then restores
// them: rank 0's decode step on the cores the other local ranks leave idle.
template <class F>
auto with_threads(int threads, F&& step) {
  struct Restore {
    int old;
    ~Restore() {
      if (old > 0) at::set_num_threads(old);
    }
  } restore{threads > 0 && threads != at::get_num_threads() ? at::get_num_threads() : 0};
  if (restore.old > 0) at::set_num_threads(threads);
  return step();
}

}  // namespace lvx::models
