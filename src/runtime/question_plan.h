// One question priced by the planner for lvx qa: the decode price per token that --print-plan
// shows (src/planner/decode_price.h: at 1 rank and the run's, rank 0 decoding alone and every
// rank), and --nproc auto's choice of rank count (src/planner/question_price.h: the prefill and
// the answer's tokens at each count), for the checkpoint's decoder on the run's cluster config.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "models/model.h"
#include "src/runtime/layer_plan.h"
#include "src/runtime/qa_job.h"

namespace lvx::runtime {

// The lines format_decode prints, or one line saying why there is no price (no cluster config,
// or one without memory bandwidth: lvx calibrate measures it). `frames` images of the model's
// visual tokens each, `text_tokens` prompt tokens, on `world` ranks.
std::string decode_price_text(const std::string& model_dir, const models::Model& model,
                              const PlanRequest& request, int64_t frames, int64_t text_tokens,
                              int world);

// The frames a question will sample, known before any frame is decoded: num_frames (default 16);
// or fps over [start, end), the end defaulting to the video's duration read from `video_path`'s
// index (no file: `unknown` frames); at most max_frames (0: no bound). lvx serve's admission by
// cost (src/serve/kv_budget.h) and --nproc auto price with it.
int64_t planned_frames(const std::optional<int64_t>& num_frames, const std::optional<double>& fps,
                       const std::optional<double>& start, const std::optional<double>& end,
                       const std::string& video_path, int64_t max_frames, int64_t unknown);

// --nproc auto: the rank count from 1 to `most` whose priced question (its frames: --num-frames,
// or --fps over the video's range; 16 by default; the prompt about frames + 64 tokens;
// --max-new-tokens) ends soonest on the job's cluster config (required: errors say to pass
// --cluster). Prints each count's price and the choice to stderr.
int choose_ranks(const QaJob& job, int most);

}  // namespace lvx::runtime
