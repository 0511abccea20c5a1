// Question answering about videos: what `lvx qa` runs on every rank.
//
// Per question, each rank samples the video's frames (the same rule on every rank), decodes and
// preprocesses only its own share (video::ShardSpec: the model's key layout) and encodes only
// those; the prompt follows the family's template (src/runtime/video_qa.h); the prefill runs with
// the plan's per-layer strategies for this prompt; generation decodes with the KV cache by
// pass-Q (models/decode.h): no rank ever holds all visual K/V. Rank 0 streams the answer's text
// as tokens arrive (single question without --json) and writes the results.
//
// Batch mode reads JSONL questions and appends one JSON row per question to the output as soon
// as it is answered (flushed): a line that fails (missing video, bad range, a bad row) gets a row
// with "error" and the others still run; rows already in the output (same id, no error) are kept
// and not asked again, so a killed run continues where it stopped. A row:
//   {id, video, question, options, answer, response, parsed_answer, correct, frames,
//    frame_indices, pts_seconds, prompt_tokens, new_tokens, plan, timings {video_decode_s,
//    encode_s, prefill_s, ttft_s, decode_per_token_s, total_s}, bytes {prefill, decode,
//    decode_per_token}}
// (timings: the slowest rank; bytes: sent by all ranks together).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "src/runtime/generate.h"
#include "src/runtime/layer_plan.h"

namespace lvx::runtime {

struct QaJob {
  std::string model;
  // One question...
  std::string video, question;
  std::vector<std::string> options;
  // ...or a JSONL file of them, answered into `output`.
  std::string questions, output;
  std::optional<double> fps;          // frames per second, or
  std::optional<int64_t> num_frames;  // N frames spread over the range (default 16)
  std::optional<double> start, end;   // seconds (a row's own range wins)
  GenerateOptions generation;         // max_new_tokens, sampling
  PlanRequest plan;
  bool json = false;        // print one JSON object per question instead of streaming text
  bool print_plan = false;  // the per-layer plan of each question (rank 0, stderr)
  bool ignore_stop = false; // generate exactly max_new_tokens (benchmarks)
};

// Runs on this rank (rendezvous from the environment). 0 when every question was answered (a
// batch with failed rows returns 0 too: the rows say why); single-question errors throw.
int run_qa_rank(const QaJob& job);

// Checks what can be checked before ranks start (model directory, video, question, flags).
void validate_qa_job(const QaJob& job);

}  // namespace lvx::runtime
