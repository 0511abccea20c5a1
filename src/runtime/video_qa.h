// Questions about videos, as `lvx qa` answers them and `lvx finetune` learns them (the JSONL row:
// src/runtime/qa_rows.h): the user turn, the preprocessing of the model's frames, and answer
// scoring.
//
// Prompts follow the released processors (built from the question by lvx, never by the user):
// each family's template is its own (models/family.h, Family::prompt), in its folder under
// models/.
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

#include "models/family.h"
#include "models/tokenizer/tokenizer.h"
#include "src/runtime/qa_rows.h"
#include "video/video_options.h"

namespace lvx::runtime {

// The user turn: the question, or the multiple-choice instruction with lettered options.
std::string question_text(const QaItem& item);

// A prompt's ids and labels (models/family.h: Family::prompt builds them).
using models::PromptTokens;

// The preprocessing of the family's vision tower (its preset: SigLIP squash / CLIP crop) at the
// model's image size, normalized.
video::PreprocessConfig family_preprocess(const models::Family& family, int64_t image_size);

// Scoring. For multiple choice, the option letter of a response ("" when none is found): strip
// "The best answer is", "The correct answer is", "Answer:", "Best option:", "(" … then the first
// letter among the options'; otherwise the response normalised (lower case, no surrounding
// punctuation or spaces).
std::string parse_answer(const QaItem& item, const std::string& response);
// What fine-tuning teaches the model to answer: the answer text, or for multiple choice the
// option letter (what the instruction asks for).
std::string training_target(const QaItem& item);
// The prompt of a training row about `frames` frames: its system message, its question (with the
// options) and training_target, then its later turns (Family::prompt_turns, which places the
// system message as prompt_chat does for lvx serve), every answer labelled.
PromptTokens training_prompt(const models::Family& family, const models::Tokenizer& tok,
                             const QaItem& item, int64_t frames);
// The ground truth in the same form ("A".."E" for multiple choice: the answer letter, or the
// letter of the option whose text equals the answer).
std::string expected_answer(const QaItem& item);

}  // namespace lvx::runtime
