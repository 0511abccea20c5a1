// Admission by cost (lvx serve --max-kv-bytes): what each request will hold on a rank, known from
// its request before any frame is decoded (its frames: runtime/question_plan.h planned_frames),
// and the budget its generation must fit in.
//
// A request's cost is the planner's KV cache of one question per rank
// (src/planner/inference_memory.h): the visual K/V of its frames in every cross layer (each rank
// holds its share) and the text K/V of its prompt and its max_tokens in every self layer. Its
// frames: the image_url parts, or num_frames, or fps over [start, end) (or over the whole video,
// read from the file's header), at most --max-frames; the server's default sampling where it
// sets neither. Its prompt: the chat template's tokens for its question and earlier turns with
// one <image> token per frame.
//
// A request whose cost exceeds the budget can never run: 400 naming its cost and the limit. One
// that fits waits in the queue (in order) until the generations running leave room; identical
// requests sharing a generation count once. Without a budget (0) admission counts requests only.
#pragma once

#include <cstdint>
#include <string>

#include "src/common/model_config.h"

namespace lvx::serve {

// One question's KV bytes per rank on `world` ranks: F frames of the model's visual tokens,
// `prompt_tokens` prompt tokens, `new_tokens` answer tokens, `elem_bytes` per value.
int64_t question_kv_bytes(const ModelConfig& m, int64_t frames, int64_t prompt_tokens,
                          int64_t new_tokens, int world, int64_t elem_bytes);

// "1610612736 bytes (1.500 GiB)" for messages.
std::string format_bytes(int64_t bytes);

}  // namespace lvx::serve
