// Text generation from a prompt (with its frames) on the ranks of a process group: one
// distributed prefill (the plan's strategies), then one pass-Q decode step per new token through
// the KV cache each rank kept (models/decode.h). Rank 0 picks every token (greedy, or seeded
// temperature / top-p sampling) and broadcasts it, so all ranks decode the same sequence.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "models/model.h"

namespace lvx::runtime {

struct SamplingOptions {
  double temperature = 0;  // 0: greedy (argmax, the lowest id on ties)
  double top_p = 1;        // nucleus: the smallest set of tokens whose probability reaches top_p
  uint64_t seed = 0;       // the same seed gives the same tokens
};

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  // > 0: the model's context length. A longer prompt is refused; generation stops when prompt
  // and new tokens fill it (GenerateResult::hit_context), whatever max_new_tokens says.
  int64_t max_length = 0;
  SamplingOptions sampling;
  std::vector<int64_t> stop;  // a sample is done after emitting one of these
  bool keep_logits = false;   // return every step's logits (tests)
  // Asked on rank 0 before each new token is sent to the other ranks (a client went away, a stop
  // string was seen): true ends generation before that token, on every rank together (the flag
  // travels with the token's broadcast). Set it on every rank or on none; only rank 0's answer
  // counts.
  std::function<bool()> stop_requested;
  // The prompt prefix (lvx serve's per-video reuse): every prompt with images runs as a prefill
  // of its prefix — up to and including the last image token of any row, which no question
  // changes — then its remaining tokens (the question and the template's tail) in one
  // Model::extend against that prefill's cache (prompt_prefix), for every caller alike, so an
  // answer does not depend on whether its prefix was reused. A family without extend, or a batch
  // with processor inputs along the sequence (ModelInputs::named, e.g. lvx forward --input of a
  // processor's output), runs its prompt whole.
  // cached_prefix: this rank's state after that prefill of the same prefix, or null; every rank
  // must answer alike (the caller agrees). store_prefix: offered the state after a prefill.
  std::function<const models::DecodeCache*()> cached_prefix;
  std::function<void(const models::DecodeCache&)> store_prefix;
  // Generation (below): leave the prompt's tail (after the prefix) for the first step_together,
  // which extends every such generation at once (Model::extend_rows): lvx serve admitting several
  // questions between two steps. generate() does not use it.
  bool defer_tail = false;
  // > 0: a prompt prefix longer than this many tokens is prefilled in chunks of at most this
  // many (lvx serve's --max-batch-tokens): Model::prefill_media, then one Model::extend per
  // Generation::prefill_next, so other generations step between the chunks. Its logits equal
  // the whole prefill's up to rounding; the chunks do not depend on what runs between them, so
  // the same chunk size gives the same answer bit for bit. 0, or a family without chunked
  // prefill (Model::can_prefill_in_chunks): the prefix runs whole.
  int64_t prefill_chunk = 0;
  // > 0, with prefill_chunk: a chunk also ends before its tokens' visual key reads (each token
  // counting the keys of the images it sees, over every rank: DecodeCache::prompt_key_reads)
  // pass this many, one token at least (lvx serve's --max-batch-visual-keys). Late in a long
  // video's prompt every token reads all of its frames' keys, so chunks there get fewer tokens;
  // but every chunk also streams those keys once whatever its token count, so more chunks cost
  // the long prompt more passes (docs/serve.md measures both). 0: chunks of prefill_chunk
  // tokens. Every rank computes the same cut from the prompt's ids: no message.
  int64_t prefill_chunk_keys = 0;
  // With prefill_chunk: this rank's Model::prefill_media of the prefix, made already (lvx serve
  // makes it on a worker thread, off the ranks' lockstep); null: the constructor makes it.
  std::shared_ptr<const models::DecodeCache> prefilled_media;
  // >= 0 (one sample only): every new token's log-probability under the model and this many
  // most likely tokens with theirs (GenerateResult::logprobs; OpenAI's logprobs/top_logprobs).
  // From the logits as the model gives them, before temperature and top-p (vLLM's default,
  // raw_logprobs), in fp32; every rank computes them from its identical logits.
  int64_t logprobs = -1;
};

// One new token's log-probability and the most likely tokens' (GenerateOptions::logprobs),
// most likely first (ties: the lower id first).
struct TokenLogprobs {
  int64_t token = 0;
  double logprob = 0;
  std::vector<std::pair<int64_t, double>> top;
};

// The prefix length of `ids` (int64 [B, L] on the host) for GenerateOptions: one past the last
// `media_token` of any row; 0 when no row has one or it is the last token (no split).
int64_t prompt_prefix(const at::Tensor& ids, int64_t media_token);

struct GenerateResult {
  at::Tensor tokens;           // int64 [B, T]: after a sample's stop token, that stop token again
  at::Tensor step_logits;      // float32 [B, T, V] with keep_logits
  double prefill_seconds = 0;  // the prompt: its prefix's prefill and the rest's decode steps
  int64_t prefix_tokens = 0;   // the prefix that ran as a prefill (0: the whole prompt did)
  bool prefix_reused = false;  // GenerateOptions::cached_prefix gave it
  int64_t prefill_chunks = 0;  // the chunks the prefix ran in (GenerateOptions::prefill_chunk)
  double encode_seconds = 0;   // the part of prefill_seconds spent encoding this rank's frames
  std::vector<double> token_seconds;  // each decode step (the first token comes from prefill)
  // This rank's bytes sent by the prefill and by the decode steps (not the token broadcasts).
  int64_t prefill_bytes_sent = 0, decode_bytes_sent = 0;
  bool hit_context = false;             // stopped because the context (max_length) was full
  bool stopped = false;                 // ended by GenerateOptions::stop_requested
  std::vector<TokenLogprobs> logprobs;  // per new token, with GenerateOptions::logprobs >= 0
};

// Refuses sampling settings that cannot give a distribution: a temperature that is not finite
// or < 0, a top_p outside (0, 1]. Errors name the flags (--temperature, --top-p).
void check_sampling(const SamplingOptions& sampling);

// `on_token` gets each new token row (int64 [B]) as soon as it is chosen (rank 0 streams text).
GenerateResult generate(const models::Model& model, const models::ModelInputs& in,
                        const models::Parallel& par, const GenerateOptions& options,
                        const std::function<void(const at::Tensor&)>& on_token = {});

// The length of the chunk that starts at position `at` of a prefix of `split` tokens: at most
// `tokens`; with key_budget > 0, no more than keep the sum of their key reads (reads: int64
// [split] on the host, DecodeCache::prompt_key_reads) within key_budget, and one at least.
int64_t chunk_length(const at::Tensor& reads, int64_t at, int64_t split, int64_t tokens,
                     int64_t key_budget);

// Whether Generation prefills a prompt whose prefix is `split` tokens in chunks.
bool prefills_in_chunks(const models::Model& model, const GenerateOptions& options, int64_t split);

// Each sample of `in` as a generation of its own, all stepped together (step_together: lvx
// serve's continuous batching: the prompts' tails in one Model::extend_rows, then
// Model::decode_rows) until each is done; the result stacks the
// rows' tokens and step logits as generate() gives them for the batch, which it equals up to
// the batched products' rounding (the same tokens). Sample b's inputs: its row of input_ids and
// of every named input with the batch as first dimension; its own images, from pixel_values
// [B, ...] (a per-sample layout of 5 or more dimensions) or from a flat [N_img, ...] in prompt
// order (its media tokens' share). Every row must generate the same number of tokens (no stop
// token: lvx forward --generate-rows). Timings and bytes: the first row's.
GenerateResult generate_rows(const models::Model& model, const models::ModelInputs& in,
                             const models::Parallel& par, const GenerateOptions& options);

// One generation in progress: what generate() keeps between tokens, so that several can step
// together (continuous batching, lvx serve). The constructor runs the prompt (prefill, or the
// prefix's prefill and one extend); each step_together() picks the next token and runs one
// decode step. Every rank makes the same generations and steps them in the same order.
class Generation {
 public:
  Generation(const models::Model& model, const models::ModelInputs& in, const models::Parallel& par,
             const GenerateOptions& options);
  bool done() const { return finished_; }
  // A prompt prefilled in chunks (GenerateOptions::prefill_chunk) has chunks left: run them
  // (prefill_next, every rank in the same order) before the generation steps.
  bool prefilling() const { return pending_.defined(); }
  // The next chunk of the prefix (one Model::extend); after the last, the prefix is sealed and
  // offered to store_prefix, and the tail runs (or waits for the first step: defer_tail).
  void prefill_next(const models::Model& model, const models::Parallel& par);
  // The result so far (tokens stacked at the end: finish()).
  GenerateResult finish();
  int64_t batch() const { return batch_; }
  // Tokens taken so far (0: the first is still to come).
  int64_t tokens_taken() const { return step_; }
  const GenerateOptions& options() const { return o_; }
  // Each new token's so far (GenerateOptions::logprobs); the last is the newest token's when
  // step_together's on_token sees it.
  const std::vector<TokenLogprobs>& logprobs() const { return r_.logprobs; }

 private:
  friend struct RowsStep;  // step_together's parts (generate.cpp)
  // The next token row from the current logits (rank 0 picks), before the broadcast.
  at::Tensor pick();
  // Takes the broadcast token row; returns whether the generation goes on (then it needs a
  // decode step).
  bool take(at::Tensor next, bool stop_now, const std::function<void(const at::Tensor&)>& on_token);

  // The prompt's tail after its prefix: extended now, or left for the first step (defer_tail).
  void start_tail(const models::Model& model, const models::Parallel& par, const at::Tensor& tail);

  GenerateOptions o_;
  at::Tensor tail_;          // the prompt's tail left for the first step (defer_tail), int64 [B, T]
  at::Tensor pending_;       // a prefix prefilled in chunks, int64 [B, split] (host), until done
  int64_t pending_at_ = 0;   // its tokens that ran
  at::Tensor pending_tail_;  // the tail after it
  int64_t batch_ = 0, max_new_ = 0, step_ = 0;
  bool finished_ = false;
  at::Generator gen_;
  at::Tensor stop_, done_, last_stop_, logits_;
  std::vector<at::Tensor> tokens_, logits_kept_;
  models::DecodeCache cache_;
  GenerateResult r_;
};

// One token of every generation in `rows` (none done) that has logits: rank 0 picks each row's
// token with its own sampler and asks each its stop_requested; one broadcast carries every row's
// tokens and flags. Then one forward runs the tokens of the rows that go on beside the prompt
// tails of the rows joining (defer_tail: they take their first token at the next step)
// (Model::extend_rows; a single generation of any batch: Model::decode_step, as generate()
// always did). on_token[i] (or none) gets row i's token.
void step_together(const std::vector<Generation*>& rows, const models::Model& model,
                   const models::Parallel& par,
                   const std::vector<std::function<void(const at::Tensor&)>>& on_token = {});

// Token `token`'s log-probability under logits [V] and the `top` most likely tokens'.
TokenLogprobs token_logprobs(const at::Tensor& logits, int64_t token, int64_t top);

// The next token of every sample from logits [B, V] (fp32) under `sampling`; `gen` carries the
// seeded state between steps.
at::Tensor pick_tokens(const at::Tensor& logits, const SamplingOptions& sampling,
                       at::Generator& gen);

}  // namespace lvx::runtime
