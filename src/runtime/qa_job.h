// Question answering about videos: what `lvx qa` runs on every rank.
//
// Per question, each rank samples the video's frames (the same rule on every rank), decodes and
// preprocesses only its own share (video::ShardSpec: the model's key layout) and encodes only
// those; the prompt follows the family's template (models/family.h: Family::prompt_chat, which
// for one question is Family::prompt); the prefill runs with the plan's per-layer strategies for
// this prompt; generation decodes with the KV cache by pass-Q (models/decode.h): no rank ever
// holds all visual K/V. Rank 0 streams the answer's text as tokens arrive (single question
// without --json) and writes the results.
//
// Batch mode reads JSONL questions and appends one JSON row per question to the output as soon
// as it is answered (flushed): a line that fails (missing video, bad range, a bad row) gets a row
// with "error" and the others still run; rows already in the output (same id, no error) are kept
// and not asked again, so a killed run continues where it stopped. The settings that shape an
// answer (model, dtype, frames, fps, range, generation) are kept beside the output in
// `<output>.settings.json`: a rerun with other settings is refused, naming the difference, unless
// --overwrite (the old output is then moved to `<output>.old` and every question asked again). A
// last line torn by a kill is moved to `<output>.torn` before new rows are appended. A question
// whose prompt does not fit the model's context (config.json max_position_embeddings or
// max_seq_len) gets a row error; generation stops when the context is full. A row:
//   {id, video, question, options, answer, response, parsed_answer, correct, frames,
//    frame_indices, pts_seconds, prompt_tokens, new_tokens, completion_tokens (before the stop
//    token), finish_reason (stop | length), plan, timings {video_decode_s,
//    encode_s, prefill_s, ttft_s, decode_per_token_s, total_s}, bytes {prefill, decode,
//    decode_per_token}}
// (timings: the slowest rank; bytes: sent by all ranks together).
//
// QaSession is the model loaded once answering many questions: `lvx qa` asks it each question of
// a run, `lvx serve` (src/serve/server.h) each request, so both give the same answer token for
// token for the same video, frames and question.
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/family.h"
#include "src/runtime/generate.h"
#include "src/runtime/layer_plan.h"
#include "src/runtime/qa_rows.h"
#include "src/runtime/visual_cache.h"

namespace lvx::dist {
class ProcessGroup;
}

namespace lvx::runtime {

struct QaJob {
  std::string model;
  std::string adapter;  // a LoRA adapter directory in PEFT's layout, merged once (models/lora.h)
  // One question...
  std::string video, question;
  std::vector<std::string> options;
  // ...or a JSONL file of them, answered into `output`.
  std::string questions, output;
  std::optional<double> fps;          // frames per second, or
  std::optional<int64_t> num_frames;  // N frames spread over the range (default 16)
  int64_t max_frames = 0;  // at most this many sampled, whatever a request asks (0: no bound)
  std::optional<double> start, end;  // seconds (a row's own range wins)
  GenerateOptions generation;        // max_new_tokens, sampling
  PlanRequest plan;                  // plan.dtype: fp32 | bf16 | auto (src/runtime/device.h)
  std::string device = "auto";       // auto | cuda | cpu (src/runtime/device.h)
  bool json = false;                 // print one JSON object per question instead of streaming text
  bool print_plan = false;           // the per-layer plan of each question (rank 0, stderr)
  bool ignore_stop = false;          // generate exactly max_new_tokens (benchmarks)
  bool overwrite = false;     // batch: answer everything again into an output of other settings
  bool side_by_side = false;  // lvx serve: models::Parallel::side_by_side (--step-overlap)
  // A question answered alone (lvx qa) decodes on rank 0, the others answering at the cross
  // layers (models/lead_decode.h; --decode-ranks one); false: every rank runs every step
  // (--decode-ranks all). lvx serve's batched rows always run on every rank. lead_threads: rank
  // 0's intra-op threads for those steps (0: its own).
  bool lead_decode = true;
  int lead_threads = 0;
};

// What the batch output's answers depend on, as written to `<output>.settings.json`.
nlohmann::json qa_settings(const QaJob& job);

// One question as a session answers it: a QaItem (id, question text, options, answer, its own
// start/end; video: a file path) and what a request may set beyond lvx qa's flags.
struct QaRequest {
  QaItem item;
  // Instead of item.video: the frames as image files (PNG, JPEG, ...; one frame each, in order),
  // all of them used (no sampling). Each rank reads its own share.
  std::vector<std::string> image_files;
  std::optional<double> fps;  // override the session's sampling (both unset: the job's)
  std::optional<int64_t> num_frames;
  std::optional<GenerateOptions> generation;  // override the job's (max_new_tokens, sampling)
  std::string video_id;  // the caller's name for the media (logs only: the cache keys by content)
  // Instead of item.video: the content hash of a video asked about before (lvx serve's `uuid`,
  // resolved by the server); only the visual cache can answer it (a miss is the row's error,
  // which says to send the video again). And whether the row gets "media_hash", the hash of
  // its video's content (what a later request's media_hash names).
  std::string media_hash;
  bool return_media_hash = false;
  // Keep the video's frame index in the index cache (video/index_cache.h); lvx serve turns it off
  // for uploads, temporary files whose index would never be read again.
  bool cache_frame_index = true;
  // A conversation (lvx serve): the answered (question, answer) turns before item.question, in
  // the family's chat template (models/family.h Family::prompt_chat) with item.system. Both
  // empty: lvx qa's prompt.
  std::vector<std::pair<std::string, std::string>> earlier;
  bool return_prompt_ids = false;  // the row gets "prompt_ids"
  // No media (lvx serve's chat without a video): the prompt holds no frame, the cross layers see
  // nothing, and the visual cache is neither read nor written.
  bool text_only = false;
  // A prompt continued as written (lvx serve's /v1/completions): tokenized by the tokenizer's own
  // pipeline (special tokens parsed, its beginning-of-text token added), no chat template; it
  // must not hold the model's media token. With raw_after_media, the request's frames go between
  // the two texts, as the family's template writes them (Family::media_ids); without, it is
  // text only.
  std::optional<std::string> raw_prompt;
  std::optional<std::string> raw_after_media;
  // The visual cache's partition: an entry made under one tenant answers only requests of that
  // tenant (lvx serve: the API key's scope, unless --shared-visual-cache). "": lvx qa's.
  std::string tenant;
};

// Rank 0's view of an answer as it is generated.
struct AnswerHooks {
  std::function<void(const std::string&)> on_text;  // rank 0: each new piece of the answer's text
  // Asked on rank 0 before each token (generate.h GenerateOptions::stop_requested): true stops
  // the answer there. Set on every rank or on none.
  std::function<bool()> stop_requested;
  // rank 0, with the request's generation.logprobs >= 0: each new token's log-probabilities in
  // OpenAI's shape (src/runtime/logprobs_json.h), after the token's text went to on_text.
  std::function<void(const nlohmann::json&)> on_logprob;
};

// One question being answered, between QaSession::start and QaSession::finish (qa_job.cpp).
struct QaAnswer;
struct QaAnswerDeleter {
  void operator()(QaAnswer* a) const;
};
using QaAnswerPtr = std::unique_ptr<QaAnswer, QaAnswerDeleter>;

// A checkpoint loaded on this rank with its tokenizer, answering questions one at a time. Every
// rank of the group makes one with the same job and calls answer() with the same requests in the
// same order (each call runs collectives). With cache_bytes > 0 each rank keeps its share of each
// video's encoded frames (src/runtime/visual_cache.h).
class QaSession {
 public:
  QaSession(const QaJob& job, std::shared_ptr<dist::ProcessGroup> pg, int64_t cache_bytes = 0);
  // A session over a model already loaded on this rank and lent for the session's life (lvx
  // finetune's evaluation: the model being trained, its LoRA branches on the activation path);
  // job.model names its directory (tokenizer.json, config.json), job.plan.dtype its dtype
  // (fp32 | bf16). No visual cache.
  QaSession(const QaJob& job, std::shared_ptr<dist::ProcessGroup> pg, models::Model& model);
  ~QaSession();
  // The row of lvx qa (see the top of this file) plus finish_reason ("stop": a stop token or
  // stop_requested; "length": max_new_tokens or the context), completion_tokens (generated
  // tokens before the stop token) and visual_cache {hits, misses: ranks; bytes: every rank's
  // cache}, and "logprobs" when the request's generation asks for them (each completion token's,
  // OpenAI's shape: src/runtime/logprobs_json.h). Errors of the video or the prompt (on any
  // rank) become the row's "error"; a failure of the process group throws.
  nlohmann::json answer(const QaRequest& request, const AnswerHooks& hooks = {});
  // answer() in parts, so that several questions generate together (lvx serve's continuous
  // batching) and a long prompt does not hold the others (its chunked prefill; qa_answer.cpp):
  //   begin()   this rank alone: the video looked up in the visual cache; on a miss its frames
  //             decoded, the prompt built and, when the prompt is prefilled in chunks
  //             (GenerateOptions::prefill_chunk), the frames encoded with their visual K/V, all
  //             on a worker thread of this rank (prepared() says when it is done, never blocks);
  //   advance() collective: waits for that worker, agrees on errors (an error of the video or
  //             the prompt gives an answer that is done at once) and starts the generation: its
  //             prompt whole, or chunks to come while prefilling() (prefill_next(), collective);
  //   step()    collective: every answer in `answers` (advanced, not prefilling, none done) its
  //             next token, one decode step for all (runtime/generate.h step_together);
  //   finish()  collective: the row once done() says so.
  // Every rank begins, advances, prefills, steps and finishes the same answers in the same order.
  // start() is begin then advance; answer() is start, the chunks, steps until done, finish.
  QaAnswerPtr begin(const QaRequest& request, const AnswerHooks& hooks = {});
  bool prepared(const QaAnswer& answer) const;
  void advance(QaAnswer& answer);
  bool advanced(const QaAnswer& answer) const;
  bool prefilling(const QaAnswer& answer) const;
  const std::string& answer_id(const QaAnswer& answer) const;  // its request's item.id
  void prefill_next(QaAnswer& answer);
  QaAnswerPtr start(const QaRequest& request, const AnswerHooks& hooks = {});
  // With it on, start() leaves each prompt's question tokens (after its kept prefix) for the
  // next step(), which runs those of every answer started since in the same forward as the
  // running answers' next tokens (GenerateOptions::defer_tail; lvx serve with --max-batch > 1);
  // such an answer takes its first token at the step after. Off by default: lvx qa.
  void batch_prompts(bool on);
  void step(const std::vector<QaAnswer*>& answers);
  bool done(const QaAnswer& answer) const;
  // Steps, and has no token yet (its prompt ran: the next step gives its first).
  bool awaits_first_token(const QaAnswer& answer) const;
  nlohmann::json finish(QaAnswer& answer);
  // The prompt of `request` about `frames` frames (what answer() builds); a question or
  // conversation the family's template refuses throws lvx::Error. Touches no other rank and
  // only reads the tokenizer: lvx serve checks requests with it on its HTTP threads.
  models::PromptTokens prompt(const QaRequest& request, int64_t frames) const;
  // The model it answers with (its shapes: lvx serve prices a request's KV from them).
  const models::Model& model() const;
  dist::ProcessGroup& group();
  const QaJob& job() const;              // plan.dtype resolved
  VisualCacheStats cache_stats() const;  // this rank's
  // Every rank's visual cache bytes, summed when a prompt's prefill last ended (the features and
  // prefix it kept) or a row last finished: lvx serve's gauge, current before any answer ends.
  int64_t cache_bytes_all() const;

  struct State;  // (qa_job.cpp)

 private:
  std::unique_ptr<State> s_;
};

// Runs on this rank (rendezvous from the environment). 0 when every question was answered (a
// batch with failed rows returns 0 too: the rows say why); single-question errors throw.
int run_qa_rank(const QaJob& job);

// Checks what can be checked before ranks start (model directory, video, question, flags).
void validate_qa_job(const QaJob& job);
// The part of it that holds for any question: the model directory, dtype, device, sampling,
// range, generation and strategy flags (lvx serve, whose questions come later).
void validate_qa_settings(const QaJob& job);

}  // namespace lvx::runtime
