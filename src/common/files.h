// Checked readers for every file lvx takes from a user: the one place that decides what a
// well-formed input file is, so that a hostile or mistaken file ends in one lvx::Error naming
// the file and what is wrong with it, before anything is allocated from its contents.
//
// - Inputs must be regular files. A FIFO, a directory or a device given where a file is expected
//   is refused at once (opened with O_NONBLOCK, so a FIFO with no writer cannot block the open).
// - Sizes are bounded before reading: a file larger than the caller's cap is refused.
// - JSON nests at most kMaxJsonDepth levels (a 100k-deep array is refused while parsing, not
//   after building it).
// - JSONL is read line by line with a bound per line; a line that does not parse is named by
//   file and line number. A last line without its newline (a writer killed mid-write) can be
//   reported as torn instead of as an error, so batch outputs can be repaired.
// - Checkpoint manifests (manifest.json: size and checksum of every file) are verified by one
//   function, whoever loads the checkpoint.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace lvx {

constexpr int kMaxJsonDepth = 64;
constexpr uint64_t kMaxJsonBytes = uint64_t{1} << 30;  // 1 GiB: any config or tokenizer fits

// Refuses a path that is missing or is not a regular file; `what` names its role in the message
// ("questions file", "model file"). Returns the file's size in bytes.
uint64_t check_regular_file(const std::string& path, const std::string& what);

// The whole file, at most `max_bytes` (an error naming the size otherwise).
std::string read_file(const std::string& path, const std::string& what,
                      uint64_t max_bytes = kMaxJsonBytes);

// An output path: when it exists it must be a regular file (never a FIFO, a directory or a
// device, which would hang or fail late), and its folder must exist or be creatable.
void check_output_path(const std::string& path, const std::string& what);

// JSON text with a nesting bound; errors name `where` (a file, or file:line).
nlohmann::json parse_json(const std::string& text, const std::string& where,
                          int max_depth = kMaxJsonDepth);
// A JSON file: check_regular_file + read_file + parse_json.
nlohmann::json read_json_file(const std::string& path, const std::string& what,
                              uint64_t max_bytes = kMaxJsonBytes);

struct JsonlOptions {
  uint64_t max_line_bytes = uint64_t{64} << 20;  // one row: 64 MiB
  // A last line with no trailing newline that does not parse is passed to `on_torn` (and not
  // an error) when set: what a writer killed mid-line leaves.
  std::function<void(uint64_t offset, const std::string& fragment)> on_torn;
  // A line longer than max_line_bytes or that does not parse (not JSON, nested too deep) is
  // passed to `on_bad_line` with its error ("<what> '<path>' line <n>: ...") and reading goes
  // on with the next line, when set; otherwise that error is thrown.
  std::function<void(int64_t line, const std::string& error)> on_bad_line;
};
// Calls fn(line_number (1-based), row) for every non-blank line of a JSONL file. Errors name
// `what`, the path and the line.
void for_each_jsonl(const std::string& path, const std::string& what,
                    const std::function<void(int64_t line, const nlohmann::json& row)>& fn,
                    const JsonlOptions& opt = {});

// Appending rows to a JSONL output: when the file's last line was torn (no trailing newline,
// e.g. the writer was killed), the fragment is moved aside to `<path>.torn` (appended there)
// and cut from the file, so that new rows never glue onto it. Returns the fragment ("" when the
// file ends cleanly or does not exist).
std::string repair_torn_jsonl(const std::string& path);

// XXH3-64 of a file's bytes as 16 hex digits (the manifest checksum since format 2).
std::string file_xxh3(const std::string& path);
// XXH3-128 of a file's content keyed by `secret` (at least 136 bytes: XXH3's custom secret), 32
// hex digits: without the secret no one can choose two contents with one hash (lvx serve's
// content keys, a per-process secret).
std::string file_keyed_xxh3(const std::string& path, const std::string& secret);
// FNV-1a 64 (manifests written before xxHash; verified, never written any more).
std::string file_fnv1a64(const std::string& path);

// Verifies `dir`/manifest.json when the directory has one: every listed file present, of its
// size and checksum. Throws lvx::Error naming the directory and the first bad file. Returns
// false when there is no manifest (a checkpoint not written by lvx).
bool verify_manifest(const std::string& dir);

// Names of files a checkpoint directory's index may point to: plain file names inside `dir`
// (no '/', no "..", not absolute). Refuses any other with an error naming `index_path`.
void check_name_inside(const std::string& name, const std::string& index_path);

}  // namespace lvx
