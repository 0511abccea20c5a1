// The rows of questions about videos, one reader for `lvx qa --questions` and for fine-tuning's
// data.train: each non-blank line of a JSONL file becomes a QaItem or the reason it cannot be
// used, so that a bad line (too long, not JSON, nested too deep, a missing or mistyped field) is
// named by file and line and does not hide the others. Lines are bounded while they are read
// (lvx::for_each_jsonl), JSON nesting at kMaxJsonDepth.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace lvx::runtime {

// One question about one video: a JSONL row of `lvx qa --questions` and of fine-tuning data.
//   {"id": "...", "video": "path", "question": "...", "options": ["...", ...],
//    "answer": "...", "start": 10.0, "end": 70.0}
// id (or question_id) defaults to "line <n>"; a relative video path resolves against the JSONL
// file's folder; options, start and end are optional; answer is required for fine-tuning.
// Rows in the formats people bring are read too (docs/finetune.md, "Data formats"):
//   ms-swift:   {"messages": [{"role": "user", "content": "<video>..."},
//                             {"role": "assistant", "content": "..."}, ...], "videos": ["path"]}
//   LLaVA/VILA: {"video": "path", "conversations": [{"from": "human", "value": "<video>\n..."},
//                                                   {"from": "gpt", "value": "..."}, ...]}
// with one video per row, its tag (<video>, or LLaVA's <image>) in the first user turn or absent
// (the family's template places the frames), user and assistant turns alternating from a user
// turn, after at most one system message, first (LLaVA's {"from": "system"}). The first turn is
// (question, answer), later ones `turns`.
struct QaItem {
  std::string id;
  std::string video;
  std::string question;
  std::vector<std::string> options;  // as written; "A. " prefixes are added when missing
  std::string answer;
  std::optional<double> start, end;  // seconds
  // Later (question, answer) turns of a multi-turn conversation: fine-tuning learns every answer
  // (models::Family::prompt_turns); lvx qa asks the first question.
  std::vector<std::pair<std::string, std::string>> turns;
  // The conversation's system message ("": none), as written. Rows and lvx serve's requests
  // carry it here alike, and the family's template places it (models::Family::prompt_turns for
  // fine-tuning, prompt_chat for lvx qa and lvx serve: one placement) or refuses it.
  std::string system;
};

// Parses one row; errors name `where` (file:line) and the field.
QaItem parse_qa_item(const nlohmann::json& row, const std::string& where,
                     const std::string& base_dir, bool need_answer);

// One line of a file of rows: the item, or why the line is unusable.
struct QaLine {
  int64_t line = 0;
  QaItem item;        // id "line <n>" when the row has none (or is unusable)
  std::string error;  // empty: item is usable
};

// Every non-blank line of the JSONL file `path`, or every element of a .json file whose top level
// is a JSON array (LLaVA's; "line <n>" is the line its element starts on). `what` names the file
// in errors ("questions file", "data.train"); a line longer than max_row_bytes or that does not
// parse is that line's error "<what> '<path>' line <n>: ...", a row parse_qa_item refuses is
// "<path>:<n>: ...". need_answer: rows without an answer are refused (fine-tuning learns it). A
// file that is missing or not a regular file is an lvx::Error.
std::vector<QaLine> read_qa_rows(const std::string& path, const std::string& what, bool need_answer,
                                 uint64_t max_row_bytes);

}  // namespace lvx::runtime
