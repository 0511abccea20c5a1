#include "src/runtime/video_qa.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>

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

bool has_letter_prefix(const std::string& option, size_t i) {
  return option.size() >= 2 && option[0] == static_cast<char>('A' + i) &&
         (option[1] == '.' || option[1] == ')' || option[1] == ':');
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

std::vector<QaLine> read_qa_jsonl(const std::string& path, bool need_answer) {
  // The checked reader (a regular file, at most 1 GiB), then each line on its own: a bad line (not
  // JSON, nested deeper than kMaxJsonDepth, longer than a row may be) becomes that line's error
  // and the others still run.
  const std::string text = read_file(path, "questions file", kMaxJsonBytes);
  constexpr size_t kMaxRowBytes = size_t{64} << 20;
  const std::string base = fs::absolute(path).parent_path().string();
  std::vector<QaLine> lines;
  int64_t n = 0;
  for (size_t b = 0; b < text.size();) {
    size_t e = text.find('\n', b);
    if (e == std::string::npos) e = text.size();
    const size_t len = e - b;
    const size_t from = b;
    b = e + 1;
    ++n;
    QaLine l;
    l.line = n;
    const std::string where = str(path, ":", n);
    if (len > kMaxRowBytes) {
      l.error = str(where, ": the row has ", len, " bytes, more than the ", kMaxRowBytes,
                    " a question may have");
    } else {
      const std::string row_text = text.substr(from, len);
      if (trim(row_text).empty()) continue;
      try {
        l.item = parse_qa_item(parse_json(row_text, where), where, base, need_answer);
      } catch (const Error& err) {
        l.error = err.what();
      }
    }
    if (l.item.id.empty()) l.item.id = str("line ", n);
    lines.push_back(std::move(l));
  }
  return lines;
}

std::string question_text(const QaItem& item) {
  if (item.options.empty()) return item.question;
  std::string letters;
  for (size_t i = 0; i < item.options.size(); ++i) {
    if (i) letters += i + 1 == item.options.size() ? ", or " : ", ";
    letters += static_cast<char>('A' + i);
  }
  std::string s =
      str("Select the best answer to the following multiple-choice question based on the video. "
          "Respond with only the letter (",
          letters, ") of the correct option.\n", item.question, "\n");
  for (size_t i = 0; i < item.options.size(); ++i) {
    const std::string& o = item.options[i];
    s += has_letter_prefix(o, i) ? o : str(static_cast<char>('A' + i), ". ", o);
    s += "\n";
  }
  return s + "The best answer is:";
}

video::PreprocessConfig family_preprocess(const models::Family& family, int64_t image_size) {
  video::PreprocessConfig p = video::PreprocessConfig::preset(family.preprocess_preset());
  p.image_size = image_size;
  p.normalize = true;
  return p;
}

std::string parse_answer(const QaItem& item, const std::string& response) {
  std::string s = trim(response);
  if (item.options.empty()) {
    std::string out;
    for (char c : s) out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const size_t b = out.find_first_not_of(" .,;:!?\"'()");
    if (b == std::string::npos) return "";
    return out.substr(b, out.find_last_not_of(" .,;:!?\"'()") - b + 1);
  }
  for (const char* prefix : {"The best answer is", "The correct answer is", "The answer is",
                             "The answer", "Best option:", "Answer:", "Option", "("}) {
    const std::string p = prefix;
    if (s.rfind(p, 0) == 0) s = trim(s.substr(p.size()));
  }
  for (char c : s) {
    const int i = c - 'A';
    if (i >= 0 && i < static_cast<int>(item.options.size())) return std::string(1, c);
  }
  return "";
}

std::string training_target(const QaItem& item) {
  return item.options.empty() ? item.answer : expected_answer(item);
}

std::string expected_answer(const QaItem& item) {
  if (item.options.empty()) return parse_answer(item, item.answer);
  const std::string a = trim(item.answer);
  if (a.size() == 1 && a[0] >= 'A' && a[0] < 'A' + static_cast<int>(item.options.size())) return a;
  for (size_t i = 0; i < item.options.size(); ++i) {
    const std::string& o = item.options[i];
    if (trim(o) == a || (has_letter_prefix(o, i) && trim(o.substr(2)) == a))
      return std::string(1, static_cast<char>('A' + i));
  }
  return parse_answer(item, a);
}

}  // namespace lvx::runtime
