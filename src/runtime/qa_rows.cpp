// The rows of questions about videos; see qa_rows.h.
#include "src/runtime/qa_rows.h"

#include <filesystem>
#include <fstream>
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

std::string resolve_video(std::string v, const std::string& base_dir) {
  if (fs::path(v).is_relative() && !base_dir.empty()) v = (fs::path(base_dir) / v).string();
  return v;
}

// One turn of a conversation: who speaks and what.
struct Turn {
  bool user = false;
  std::string text, field;  // field: "messages[2].content", for errors
};

// The (question, answer) pairs of a conversation in ms-swift's or LLaVA's shape, its video tag
// removed (`tags`: the spellings of the tag).
QaItem conversation_item(const std::vector<Turn>& turns, const std::vector<std::string>& tags,
                         const std::string& where, bool need_answer) {
  LVX_CHECK(!turns.empty(), where, ": the conversation has no turns");
  QaItem it;
  std::vector<std::string> questions, answers;
  int tag_count = 0;
  for (size_t i = 0; i < turns.size(); ++i) {
    const Turn& t = turns[i];
    LVX_CHECK(t.user == (i % 2 == 0), where, ": field '", t.field, "': expected a ",
              i % 2 == 0 ? "user" : "assistant",
              " turn (turns alternate, starting with the user's)");
    std::string text = t.text;
    for (const std::string& tag : tags)
      for (size_t at = text.find(tag); at != std::string::npos; at = text.find(tag)) {
        LVX_CHECK(t.user && i == 0, where, ": field '", t.field, "': a ", tag,
                  " tag outside the first user turn (lvx puts the row's one video there)");
        ++tag_count;
        size_t len = tag.size();
        if (at + len < text.size() && text[at + len] == '\n') ++len;
        text.erase(at, len);
      }
    text = trim(text);
    LVX_CHECK(!text.empty() || !t.user, where, ": field '", t.field, "' is empty");
    (t.user ? questions : answers).push_back(text);
  }
  LVX_CHECK(tag_count <= 1, where, ": ", tag_count, " video tags; lvx reads one video per row");
  LVX_CHECK(!need_answer || answers.size() == questions.size(), where, ": field '",
            turns.back().field, "': the conversation ends with a user turn (fine-tuning learns ",
            "the assistant's answers)");
  for (size_t i = 0; i < answers.size(); ++i)
    LVX_CHECK(!need_answer || !answers[i].empty(), where, ": field '", turns[2 * i + 1].field,
              "' is empty");
  it.question = questions[0];
  if (!answers.empty()) it.answer = answers[0];
  for (size_t i = 1; i < questions.size(); ++i)
    it.turns.emplace_back(questions[i], i < answers.size() ? answers[i] : "");
  return it;
}

// The text of a system message, `field` its role (or from): only the first message may be one.
// Its text goes as written (untrimmed, "" for none), as lvx serve takes a request's
// (src/serve/openai_api.cpp), so that the family's template gets the same string from both.
// How a row format spells a conversation: ms-swift {"messages": [{"role", "content"}]} with
// user/assistant, LLaVA {"conversations": [{"from", "value"}]} with human/gpt; both may open
// with a system message.
struct ConversationShape {
  const char *list, *role, *text, *user, *assistant;
};

// The row's turns, and its system message (first only; one elsewhere is an error naming it).
std::vector<Turn> read_turns(const nlohmann::json& row, const ConversationShape& k,
                             const std::string& where, std::string* system) {
  const nlohmann::json& m = row[k.list];
  LVX_CHECK(m.is_array(), where, ": field '", k.list, "' must be a list of {", k.role, ", ", k.text,
            "}");
  std::vector<Turn> turns;
  for (size_t i = 0; i < m.size(); ++i) {
    const std::string f = str(k.list, "[", i, "]");
    LVX_CHECK(m[i].is_object() && m[i].contains(k.role) && m[i][k.role].is_string() &&
                  m[i].contains(k.text) && m[i][k.text].is_string(),
              where, ": field '", f, "' must be {\"", k.role, "\": ..., \"", k.text,
              "\": \"...\"}");
    const std::string role = m[i][k.role].get<std::string>();
    const std::string text = m[i][k.text].get<std::string>();
    if (role == "system") {
      LVX_CHECK(i == 0, where, ": field '", f, ".", k.role, "': a system message after the first ",
                "message (the family's template places the system message first; only the first ",
                "may be one)");
      *system = text;
      continue;
    }
    LVX_CHECK(role == k.user || role == k.assistant, where, ": field '", f, ".", k.role,
              "': expected ", k.user, ", ", k.assistant, " or system, got '", role, "'");
    turns.push_back({role == k.user, text, f + "." + k.text});
  }
  return turns;
}

std::string id_of(const nlohmann::json& row) {
  if (row.contains("id"))
    return row["id"].is_string() ? row["id"].get<std::string>() : row["id"].dump();
  return "";
}

// ms-swift: {"messages": [{"role", "content"}...], "videos": ["path"]}.
QaItem parse_swift_row(const nlohmann::json& row, const std::string& where,
                       const std::string& base_dir, bool need_answer) {
  std::string system;
  const std::vector<Turn> turns =
      read_turns(row, {"messages", "role", "content", "user", "assistant"}, where, &system);
  QaItem it = conversation_item(turns, {"<video>"}, where, need_answer);
  it.system = system;
  LVX_CHECK(row.contains("videos"), where, ": missing field 'videos'");
  const nlohmann::json& v = row["videos"];
  LVX_CHECK(v.is_string() || (v.is_array() && v.size() == 1 && v[0].is_string()), where,
            ": field 'videos' must hold one video path (lvx reads one video per row), got ",
            v.dump().substr(0, 200));
  it.video =
      resolve_video(v.is_string() ? v.get<std::string>() : v[0].get<std::string>(), base_dir);
  it.id = id_of(row);
  return it;
}

// LLaVA / VILA: {"video": "path", "conversations": [{"from": "human"|"gpt", "value"}...]}.
QaItem parse_llava_row(const nlohmann::json& row, const std::string& where,
                       const std::string& base_dir, bool need_answer) {
  std::string system;
  const std::vector<Turn> turns =
      read_turns(row, {"conversations", "from", "value", "human", "gpt"}, where, &system);
  QaItem it = conversation_item(turns, {"<video>", "<image>"}, where, need_answer);
  it.system = system;
  LVX_CHECK(row.contains("video"), where, ": missing field 'video'");
  it.video = resolve_video(string_field(row, "video", where), base_dir);
  it.id = id_of(row);
  return it;
}

// Whether the file is a .json file whose first non-blank byte opens a JSON array (a .jsonl file
// is read line by line whatever its first row looks like).
bool json_array_file(const std::string& path) {
  if (fs::path(path).extension() != ".json") return false;
  check_regular_file(path, "rows file");
  std::ifstream f(path, std::ios::binary);
  for (char c; f.get(c);)
    if (c != ' ' && c != '\t' && c != '\r' && c != '\n') return c == '[';
  return false;
}

// The 1-based line on which each element of the top-level array in `text` starts.
std::vector<int64_t> element_lines(const std::string& text) {
  std::vector<int64_t> starts;
  int64_t line = 1;
  int depth = 0;
  bool in_string = false, escaped = false, want = false;
  for (char c : text) {
    if (c == '\n') ++line;
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (depth == 1 && want && c != ' ' && c != '\t' && c != '\r' && c != '\n' && c != ']') {
      starts.push_back(line);
      want = false;
    }
    if (c == '"') in_string = true;
    if (c == '[' || c == '{') {
      if (++depth == 1) want = true;
    } else if (c == ']' || c == '}') {
      --depth;
    } else if (c == ',' && depth == 1) {
      want = true;
    }
  }
  return starts;
}

}  // namespace

QaItem parse_qa_item(const nlohmann::json& row, const std::string& where,
                     const std::string& base_dir, bool need_answer) {
  LVX_CHECK(row.is_object(), where, ": expected a JSON object, got ", row.type_name());
  if (row.contains("messages") || row.contains("conversations")) {
    QaItem it = row.contains("messages") ? parse_swift_row(row, where, base_dir, need_answer)
                                         : parse_llava_row(row, where, base_dir, need_answer);
    LVX_CHECK(!it.video.empty(), where, ": the video path is empty");
    it.start = time_field(row, "start", where);
    it.end = time_field(row, "end", where);
    LVX_CHECK(!(it.start && it.end) || *it.start < *it.end, where, ": 'start' (",
              it.start.value_or(0), " s) must be before 'end' (", it.end.value_or(0), " s)");
    return it;
  }
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
  if (json_array_file(path)) {  // LLaVA's .json: one array of rows
    const std::string text = read_file(path, what);
    const nlohmann::json rows = parse_json(text, path);
    LVX_CHECK(rows.is_array(), path, ": expected a JSON array of rows");
    const std::vector<int64_t> starts = element_lines(text);
    LVX_CHECK(starts.size() == rows.size(), path, ": could not locate the rows of the array");
    for (size_t i = 0; i < rows.size(); ++i) {
      const int64_t n = starts[i];
      try {
        add(n, parse_qa_item(rows[i], str(path, ":", n), base, need_answer), "");
      } catch (const Error& e) {
        add(n, {}, e.what());
      }
    }
    return lines;
  }
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
