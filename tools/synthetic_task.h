// A synthetic long-video QA task for `lvx demo`: many minutes-long tiny videos in which exactly
// one thing happens, and a question about it. Each video shows a grey background with grey
// distractors (slowly drifting brightness, slowly moving grey shapes, faint luma noise: never a
// saturated colour) and, for `event_seconds` starting at a uniformly random frame, one large
// saturated shape (square, circle or triangle) in one of six colours. The question asks for the
// colour ("What colour was the shape that appeared in the video?" → "red"); optionally a second
// row per video asks for the shape. A model can only answer by finding the event in the long
// video, and a model shown another video (the shuffled baseline) is at chance (1 in 6).
//
// Layout written under `dir`:
//   videos/<id>.mp4   one per video, MPEG-4 Part 2 (video/encoder.h), `size`×`size`, `fps`
//   all.jsonl         every row, ids in order
//   train.jsonl       rows of the training videos
//   test.jsonl        rows of the held-out videos (no video is in both)
// One JSON object per line:
//   {"id": "synth_00007", "video": "/abs/dir/videos/synth_00007.mp4", "question": "...",
//    "options": ["red", "green", ...], "answer": "red", "event_start": 61.5, "event_end": 73.5}
// "video" is an ABSOLUTE path (any command can open it from any working directory; moving the
// directory needs a regeneration, which takes seconds). event_start/event_end are seconds: the
// event shows on exactly the frames with pts in [event_start, event_end) (frame i has pts i/fps).
//
// Everything is a function of the spec: the same spec (seed included) gives byte-identical
// JSONL and video files, whatever the number of threads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lvx::tools {

struct SyntheticTaskSpec {
  int64_t videos = 200;          // number of videos (one colour question each)
  double seconds = 180;          // length of each video: "a few minutes"
  int fps = 2;                   // frames per second stored in the files
  int size = 48;                 // frame width = height in pixels (even)
  double event_seconds = 12;     // how long the coloured shape is visible
  int64_t seed = 0;              // everything random derives from it
  bool shape_questions = false;  // also one "What shape appeared in the video?" row per video
  // Rows list the answers as "options" (multiple choice, Video-MME style: lvx asks for and learns
  // the option letter); false: free-form questions whose answer is the word itself.
  bool multiple_choice = false;
  double test_fraction = 0.25;  // share of each colour's videos held out in test.jsonl
  int threads = 0;              // encoding threads; 0: one per core
};

// The answer vocabularies, lowercase single words, in label order (colour k is answer k).
const std::vector<std::string>& synthetic_colours();  // red green blue yellow magenta cyan
const std::vector<std::string>& synthetic_shapes();   // square circle triangle
// The RGB value drawn for colour k of synthetic_colours().
std::vector<uint8_t> synthetic_colour_rgb(int64_t k);
// The questions, word for word.
extern const char* const
    kColourQuestion;                      // "What colour was the shape that appeared in the video?"
extern const char* const kShapeQuestion;  // "What shape appeared in the video?"
// Every word of the questions and answers plus the chat roles ("user", "assistant"), without
// punctuation, each once: give these to the tokenizer (models/init.h) so each is one token.
std::vector<std::string> synthetic_task_words();

// One JSONL row (the fields above).
struct TaskRow {
  std::string id, video, question, answer;
  std::vector<std::string> options;
  double event_start = 0, event_end = 0;
};

struct SyntheticTask {
  std::string dir;  // absolute
  std::string all_jsonl, train_jsonl, test_jsonl;
  std::vector<TaskRow> train, test;
};

// Writes the task under `dir` (created if missing; files of an earlier task are overwritten).
// Answers are balanced: the colours are dealt round-robin over the videos and shuffled, so each
// colour answers videos/6 questions (±1), and the test split takes the same share of every colour.
// Throws lvx::Error naming the field for a bad spec and the file for an I/O error.
SyntheticTask generate_synthetic_task(const std::string& dir, const SyntheticTaskSpec& spec);

// Reads rows written above (or by hand: "options", "event_start" and "event_end" may be absent).
// Errors name the file, the line and the field.
std::vector<TaskRow> read_task_jsonl(const std::string& path);

}  // namespace lvx::tools
