// The rows of questions about videos; see qa_rows.h.
#include "src/runtime/qa_rows.h"

#include <filesystem>
#include <utility>

#include "src/common/error.h"
#include "src/common/files.h"

namespace lvx::runtime {

namespace fs = std::filesystem;

namespace {

std::string string_field(const nlohmann::json& row, const std::string& key,
                         const std::string& where) {
  LVX_CHECK(row[key].is_string(), where, ": field '", key, "' must be a string, got ",
            row[key].type_name());
  return row[key].get<std::string>();
}

std::optional<double> time_field(const nlohmann::json& row, const std::string& key,
                                 const std::string& where) {
  if (!row.contains(key) || row[key].is_null()) return std::nullopt;
  LVX_CHECK(row[key].is_number(), where, ": field '", key, "' must be a number of seconds, got ",
            row[key].dump());
  const double t = row[key].get<double>();
  LVX_CHECK(t >= 0, where, ": field '", key, "' must be >= 0 seconds, got ", t);
  return t;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

}  // namespace

QaItem parse_qa_item(const nlohmann::json& row, const std::string& where,
                     const std::string& base_dir, bool need_answer) {
  LVX_CHECK(row.is_object(), where, ": expected a JSON object, got ", row.type_name());
  QaItem it;
  for (const char* key : {"video", "question"})
    LVX_CHECK(row.contains(key), where, ": missing field '", key, "'");
  if (row.contains("id")) {
    it.id = row["id"].is_string() ? row["id"].get<std::string>() : row["id"].dump();
  } else if (row.contains("question_id")) {
    const auto& q = row["question_id"];
    it.id = q.is_string() ? q.get<std::string>() : q.dump();
  }
  it.video = string_field(row, "video", where);
  LVX_CHECK(!it.video.empty(), where, ": field 'video' is empty");
  if (fs::path(it.video).is_relative() && !base_dir.empty())
    it.video = (fs::path(base_dir) / it.video).string();
  it.question = trim(string_field(row, "question", where));
  LVX_CHECK(!it.question.empty(), where, ": field 'question' is empty");
  if (row.contains("options") && !row["options"].is_null()) {
    LVX_CHECK(row["options"].is_array(), where, ": field 'options' must be a list of strings");
    for (const auto& o : row["options"]) {
      LVX_CHECK(o.is_string(), where, ": field 'options' must be a list of strings, got ",
                o.dump());
      it.options.push_back(o.get<std::string>());
    }
    LVX_CHECK(it.options.size() >= 2 && it.options.size() <= 26, where,
              ": field 'options' needs 2 to 26 options, got ", it.options.size());
  }
  if (row.contains("answer") && !row["answer"].is_null())
    it.answer = row["answer"].is_string() ? row["answer"].get<std::string>() : row["answer"].dump();
  LVX_CHECK(!need_answer || !trim(it.answer).empty(), where,
            ": missing field 'answer' (fine-tuning learns it)");
  it.start = time_field(row, "start", where);
  it.end = time_field(row, "end", where);
  LVX_CHECK(!(it.start && it.end) || *it.start < *it.end, where, ": 'start' (",
            it.start.value_or(0), " s) must be before 'end' (", it.end.value_or(0), " s)");
  return it;
}

std::vector<QaLine> read_qa_rows(const std::string& path, const std::string& what, bool need_answer,
                                 uint64_t max_row_bytes) {
  const std::string base = fs::absolute(path).parent_path().string();
  std::vector<QaLine> lines;
  auto add = [&](int64_t n, QaItem item, std::string error) {
    if (item.id.empty()) item.id = str("line ", n);
    lines.push_back({n, std::move(item), std::move(error)});
  };
  JsonlOptions o;
  o.max_line_bytes = max_row_bytes;
  o.on_bad_line = [&](int64_t n, const std::string& error) { add(n, {}, error); };
  for_each_jsonl(
      path, what,
      [&](int64_t n, const nlohmann::json& row) {
        try {
          add(n, parse_qa_item(row, str(path, ":", n), base, need_answer), "");
        } catch (const Error& e) {
          add(n, {}, e.what());
        }
      },
      o);
  return lines;
}

}  // namespace lvx::runtime
