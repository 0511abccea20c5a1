// Questions about videos, as `lvx qa` answers them and `lvx finetune` learns them (the JSONL row:
// src/runtime/qa_rows.h): the families' prompt templates, this rank's frames, and answer scoring.
//
// Prompts follow the released processors (built from the question by lvx, never by the user):
//   mPLUG-Owl3 (Qwen chatml; a video is one <|image|> per frame, then "\n"; 241101 brackets the
//   frames with <|start_video_frame|> … <|end_video_frame|> when the tokenizer has them):
//     <|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|image|>…<|image|>\n{question}<|im_end|>
//     \n<|im_start|>assistant\n{answer}<|im_end|>
//   OpenFlamingo (its VQA evaluation prompt; each frame an <image> followed by <|endofchunk|>):
//     <image><|endofchunk|>…<image>Question:{question} Short answer:{answer}<|endofchunk|>
// Multiple choice (options given) uses Video-MME's official instruction:
//   "Select the best answer to the following multiple-choice question based on the video.
//    Respond with only the letter (A, B, C, or D) of the correct option.\n{question}\n
//    A. …\nB. …\nThe best answer is:"
// and the answer letter is extracted as lmms-eval does (strip the known prefixes, take the first
// option letter).
#pragma once

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "models/tokenizer/tokenizer.h"
#include "src/runtime/qa_rows.h"
#include "video/video_options.h"

namespace lvx::runtime {

// The user turn: the question, or the multiple-choice instruction with lettered options.
std::string question_text(const QaItem& item);

// The family's prompt token ids for `frames` frames and the question (and the answer, for
// fine-tuning). Labels follow lvx forward's convention (not shifted: position t's logits predict
// labels[t]): labels[t] = ids[t + 1] where ids[t + 1] is a token of the answer or the end of the
// turn, −100 everywhere else — the loss is on the answer only.
struct PromptTokens {
  std::vector<int64_t> ids;
  std::vector<int64_t> labels;  // same length as ids
};
PromptTokens build_prompt(const std::string& family, const models::Tokenizer& tok,
                          const std::string& question, int64_t frames,
                          const std::string* answer = nullptr);

// The token that ends an answer (<|im_end|> / <|endofchunk|>), and every token that stops
// generation (those and the tokenizer's <|endoftext|> when it has one).
std::vector<int64_t> stop_tokens(const std::string& family, const models::Tokenizer& tok);

// The preprocessing of the family's vision tower at its image size (SigLIP squash / CLIP crop).
video::PreprocessConfig family_preprocess(const std::string& family, int64_t image_size);

// Scoring. For multiple choice, the option letter of a response ("" when none is found): strip
// "The best answer is", "The correct answer is", "Answer:", "Best option:", "(" … then the first
// letter among the options'; otherwise the response normalised (lower case, no surrounding
// punctuation or spaces).
std::string parse_answer(const QaItem& item, const std::string& response);
// What fine-tuning teaches the model to answer: the answer text, or for multiple choice the
// option letter (what the instruction asks for).
std::string training_target(const QaItem& item);
// The ground truth in the same form ("A".."E" for multiple choice: the answer letter, or the
// letter of the option whose text equals the answer).
std::string expected_answer(const QaItem& item);

}  // namespace lvx::runtime
