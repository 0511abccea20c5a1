// The requests of both endpoints read (openai_api.h); the response objects are openai_objects.cpp.
// Just past 600 lines: the chat and completions parsers share this file's private field readers
// (numbers, parts, media URLs, sampling), which a split would have to export to each other.
#include "src/serve/openai_api.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <mutex>
#include <random>
#include <regex>

#include "src/common/error.h"
#include "src/common/files.h"
#include "src/serve/request_fields.h"

namespace lvx::serve {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return "a number";
  }
}

// An optional boolean field (null counts as absent).
std::optional<bool> boolean(const json& body, const char* key) {
  if (!body.contains(key) || body[key].is_null()) return std::nullopt;
  if (!body[key].is_boolean())
    throw bad_request(std::string("'") + key + "' must be a boolean, got " + type_name(body[key]),
                      key);
  return body[key].get<bool>();
}

// An optional number field of the body (null counts as absent).
std::optional<double> number(const json& body, const char* key, double lo, double hi) {
  if (!body.contains(key) || body[key].is_null()) return std::nullopt;
  const json& v = body[key];
  if (!v.is_number())
    throw bad_request(std::string("'") + key + "' must be a number, got " + type_name(v), key);
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    throw bad_request(std::string("'") + key + "' must be in [" + json(lo).dump() + ", " +
                          json(hi).dump() + "], got " + preview(v.dump()),
                      key);
  return x;
}

std::optional<int64_t> integer(const json& body, const char* key, int64_t lo, int64_t hi) {
  if (!body.contains(key) || body[key].is_null()) return std::nullopt;
  const json& v = body[key];
  if (!v.is_number_integer() && !v.is_number_unsigned())
    throw bad_request(std::string("'") + key + "' must be an integer, got " +
                          (v.is_number() ? preview(v.dump()) : type_name(v)),
                      key);
  const int64_t x = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                        ? INT64_MAX
                        : v.get<int64_t>();
  if (x < lo || x > hi)
    throw bad_request(std::string("'") + key + "' must be in [" + std::to_string(lo) + ", " +
                          std::to_string(hi) + "], got " + preview(v.dump()),
                      key);
  return x;
}

std::string ext_of_media_type(const std::string& type) {
  static const std::pair<const char*, const char*> known[] = {
      {"video/mp4", ".mp4"},       {"video/webm", ".webm"}, {"video/x-matroska", ".mkv"},
      {"video/quicktime", ".mov"}, {"video/avi", ".avi"},   {"video/x-msvideo", ".avi"},
      {"image/png", ".png"},       {"image/jpeg", ".jpg"},  {"image/jpg", ".jpg"},
      {"image/webp", ".webp"},     {"image/bmp", ".bmp"},   {"image/gif", ".gif"}};
  for (const auto& [t, e] : known)
    if (type == t) return e;
  return ".bin";  // FFmpeg probes the content
}

std::string percent_decode(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
      out += static_cast<char>(std::stoi(s.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// A media URL of part `param`: data:<kind>/...;base64,... or file://<absolute path> under the
// allowed folder.
MediaRef media_url(const json& part, const std::string& field, const std::string& kind,
                   const ApiOptions& o) {
  const std::string param = "messages[].content[]." + field;
  if (!part.contains(field) || !part[field].is_object() || !part[field].contains("url") ||
      !part[field]["url"].is_string())
    throw bad_request("a " + field + " part needs {\"" + field + "\": {\"url\": \"...\"}}", param);
  // The URL in place: a data URL of a 50 MB video is 67 MB of text, so it is neither copied nor
  // cut out; its base64 moves into the request (the body is done with), decoded later straight
  // into its file (upload.h).
  std::string& url = const_cast<std::string&>(part[field]["url"].get_ref<const std::string&>());
  MediaRef m;
  if (url.rfind("data:", 0) == 0) {
    const size_t comma = url.find(',');
    const std::string head = url.substr(5, comma == std::string::npos ? 0 : comma - 5);
    if (comma == std::string::npos || head.size() < 7 ||
        head.compare(head.size() - 7, 7, ";base64") != 0)
      throw bad_request(field + ": a data URL must be data:" + kind + "/<type>;base64,<bytes>",
                        param);
    const std::string type = head.substr(0, head.size() - 7);
    if (type.rfind(kind + "/", 0) != 0 && type != "application/octet-stream")
      throw bad_request(
          field + ": a data URL of type '" + type + "' where " + kind + "/... was expected", param);
    const std::string_view text = std::string_view(url).substr(comma + 1);
    const size_t unpadded = text.find_last_not_of('=');
    if (unpadded == std::string_view::npos)
      throw bad_request(field + ": the data URL holds no bytes", param);
    if (text.size() - unpadded - 1 > 2 || (unpadded + 1) % 4 == 1)
      throw bad_request(field + ": the data URL's base64 is malformed", param);
    m.ext = ext_of_media_type(type);
    m.field = field;
    url.erase(0, comma + 1);  // the base64 alone, in place (no copy)
    m.base64 = std::move(url);
    return m;
  }
  if (url.rfind("file://", 0) == 0) {
    const std::string path = percent_decode(url.substr(7));
    if (o.allowed_media_path.empty())
      throw ApiError(403, "permission_error",
                     field +
                         ": file:// URLs are refused: the server was started without "
                         "--allowed-local-media-path",
                     param);
    if (path.empty() || path[0] != '/')
      throw bad_request(field + ": a file:// URL needs an absolute path, got '" + url + "'", param);
    std::error_code ec;
    const fs::path root = fs::weakly_canonical(o.allowed_media_path, ec);
    const fs::path p = fs::weakly_canonical(path, ec);  // symbolic links resolved
    const fs::path rel = p.lexically_relative(root);
    if (ec || rel.empty() || *rel.begin() == ".." || rel.is_absolute())
      throw ApiError(403, "permission_error",
                     field + ": '" + path + "' is outside the allowed local media path '" +
                         o.allowed_media_path + "'",
                     param);
    m.path = p.string();
    return m;
  }
  throw bad_request(
      field + ": the URL must be a data: URL or a file:// URL (got '" + url.substr(0, 64) + "')",
      param);
}

}  // namespace

std::string client_error_text(const std::string& internal) {
  static const std::regex source(R"(\s*[\(\[][^\)\]\n]*\.(cpp|cc|cu|h|hpp):[0-9]+[\)\]])");
  static const std::regex upload(
      R"([^\s'"]*lvx-serve-[A-Za-z0-9]{6}/(video|frame)([0-9]*)\.[A-Za-z0-9]+)");
  std::string t = std::regex_replace(internal, source, "");
  t = std::regex_replace(t, upload, "the uploaded $1 $2");
  t = std::regex_replace(t, std::regex(R"(the uploaded video )"), "the uploaded video");
  return t;
}

std::string ApiError::body_text() const {
  // Invalid UTF-8 in a client's text (a model name, a key) must not turn the answer into a 500.
  return body().dump(-1, ' ', false, json::error_handler_t::replace);
}

json ApiError::body() const {
  return {{"error",
           {{"message", what()},
            {"type", type},
            {"param", param.empty() ? json() : json(param)},
            {"code", code.empty() ? json() : json(code)}}}};
}

std::string preview(const std::string& s) { return s.size() <= 64 ? s : s.substr(0, 61) + "..."; }

ApiError bad_request(const std::string& message, const std::string& param) {
  return ApiError(400, "invalid_request_error", message, param);
}

bool base64_decode(std::string_view text, const std::function<void(std::string_view)>& sink) {
  auto value = [](unsigned char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
  };
  size_t n = text.size();
  while (n > 0 && text[n - 1] == '=') --n;
  if (text.size() - n > 2 || n % 4 == 1) return false;
  constexpr size_t kPiece = size_t{1} << 20;
  std::string out;
  out.reserve(std::min(kPiece, n * 3 / 4));
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < n; ++i) {
    const int v = value(static_cast<unsigned char>(text[i]));
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xFF);
      if (out.size() == kPiece) {
        sink(out);
        out.clear();
      }
    }
  }
  if (!out.empty()) sink(out);
  return true;
}

namespace {

// The body as JSON: nesting bounded before parsing (common/files.h), errors that quote nothing
// of the body.
json parse_body(const std::string& text) {
  try {
    return parse_json(text, "the body");
  } catch (const lvx::Error& e) {
    const std::string m = e.what();
    if (m.find("nested deeper") != std::string::npos)
      throw bad_request("the body nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  }
  try {  // parse_json's message quotes the text; find where it fails without quoting it
    return json::parse(text);
  } catch (const json::parse_error& e) {
    throw bad_request("the body is not valid JSON (error at byte " + std::to_string(e.byte) + ")");
  } catch (const std::exception&) {
    throw bad_request("the body is not valid JSON");
  }
}

// A media part's `uuid` (vLLM's name for the media, scoped to the API key by the server): "" when
// absent or null; 1 to 256 printable characters.
std::string part_uuid(const json& part, const std::string& param) {
  if (!part.contains("uuid") || part["uuid"].is_null()) return "";
  const std::string u = part["uuid"].is_string() ? part["uuid"].get<std::string>() : "";
  const bool printable =
      !u.empty() && u.size() <= 256 && std::all_of(u.begin(), u.end(), [](char c) {
        return static_cast<unsigned char>(c) >= 0x20 && c != 0x7f;
      });
  if (!printable)
    throw bad_request(param + ": a uuid must be a string of 1 to 256 printable characters",
                      param + ".uuid");
  return u;
}

// One content part (param: the field holding the parts): a text part's text, or nullopt for a
// media part, which goes into r.
std::optional<std::string> read_part(const json& part, const std::string& role,
                                     const std::string& param, const std::string& field,
                                     const ApiOptions& o, ChatRequest& r) {
  if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
    throw bad_request(field + " parts must be objects with a 'type'", field);
  const std::string type = part["type"].get<std::string>();
  if (type == "text") {
    if (!part.contains("text") || !part["text"].is_string())
      throw bad_request(param + ": a text part needs 'text' (a string)", field);
    return part["text"].get<std::string>();
  }
  if (type != "video_url" && type != "image_url")
    throw bad_request(param + ": content part type '" + preview(type) +
                          "' is not supported (text, video_url, image_url)",
                      field);
  if (role != "user") throw bad_request(param + ": media parts belong in user messages", field);
  if (type == "video_url") {
    if (r.video || !r.video_uuid.empty())
      throw bad_request("one video per request: a second video_url part in " + param, field);
    r.video_uuid = part_uuid(part, field);
    // vLLM's convention: the media may be left out (null) where its uuid names it.
    if (r.video_uuid.empty() || (part.contains("video_url") && !part["video_url"].is_null()))
      r.video = media_url(part, "video_url", "video", o);
  } else {
    if (part.contains("uuid"))
      throw bad_request(param +
                            ": a uuid is taken on a video_url part only (frames sent as "
                            "image_url parts are found in the cache by their content)",
                        field);
    r.frames.push_back(media_url(part, "image_url", "image", o));
  }
  return std::nullopt;
}

// The text of one message's content; its media parts go into r.
std::string read_content(const json& m, const std::string& role, const std::string& param,
                         const ApiOptions& o, ChatRequest& r) {
  static const json none;  // a reference, never a copy: a data URL may be 67 MB of text
  const json& content = m.contains("content") ? m["content"] : none;
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) {
    if (role == "assistant" && content.is_null()) return "";
    throw bad_request(param + ".content must be a string or an array of parts", param + ".content");
  }
  std::string text;
  for (const json& part : content)
    if (const auto t = read_part(part, role, param, param + ".content", o, r))
      text += (text.empty() ? "" : "\n") + *t;
  return text;
}

struct Turn {
  std::string role, text;
  size_t first_message = 0;
};

// The conversation: system messages first, then user and assistant turns alternating from a
// user turn (consecutive messages of one role are one turn, their texts joined by "\n").
std::vector<Turn> read_turns(const json& messages, const ApiOptions& o, ChatRequest& r) {
  std::vector<Turn> turns;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string param = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw bad_request(param + " must be an object with a 'role'", param);
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "developer")
      throw bad_request(
          param + ".role '" + preview(role) + "' is not system, developer, user or assistant",
          param + ".role");
    const std::string text = read_content(m, role, param, o, r);
    if (role == "system" || role == "developer") {
      if (!turns.empty())
        throw bad_request(param + ": a " + role +
                              " message after the conversation began; the chat template takes "
                              "system messages first",
                          param + ".role");
      if (!text.empty()) {
        r.system += (r.system.empty() ? "" : "\n") + text;
        if (r.system_param.empty()) r.system_param = param;
      }
      continue;
    }
    if (turns.empty() && role != "user")
      throw bad_request(param + ": the conversation must begin with a user message",
                        param + ".role");
    if (!turns.empty() && turns.back().role == role) {
      if (!text.empty()) turns.back().text += (turns.back().text.empty() ? "" : "\n") + text;
    } else {
      turns.push_back({role, text, i});
    }
  }
  return turns;
}

// The question, the answered turns and the media checks.
void read_conversation(const json& messages, const ApiOptions& o, ChatRequest& r) {
  const std::vector<Turn> turns = read_turns(messages, o, r);
  if (turns.empty() || turns.back().role != "user")
    throw bad_request("the last message must be the user's question", "messages");
  for (const Turn& t : turns)
    if (t.role == "user" && t.text.find_first_not_of(" \t\r\n") == std::string::npos)
      throw bad_request(
          turns.size() == 1 || &t == &turns.back()
              ? "the last user message has no text (the question)"
              : "messages[" + std::to_string(t.first_message) +
                    "]: a user turn has no text (every question of a conversation needs one)",
          "messages");
  const bool video = r.video || !r.video_uuid.empty();
  if (video && !r.frames.empty())
    throw bad_request("give a video_url part or image_url frames, not both", "messages");
  if (static_cast<int64_t>(r.frames.size()) > o.max_frames)
    throw bad_request("at most " + std::to_string(o.max_frames) + " image_url frames, got " +
                          std::to_string(r.frames.size()),
                      "messages");
  for (size_t i = 0; i + 1 < turns.size(); i += 2)
    r.earlier.emplace_back(turns[i].text, turns[i + 1].text);
  r.question = turns.back().text;
}

}  // namespace

uint64_t fresh_seed() {
  static std::mutex mu;
  static std::random_device device;
  std::lock_guard<std::mutex> lock(mu);
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

namespace {

void read_sampling(const json& body, const ApiOptions& o, ChatRequest& r) {
  r.n = integer(body, "n", 1, kMaxChoices).value_or(1);
  const auto mt = integer(body, "max_completion_tokens", 1, 1 << 20);
  const auto mt2 = integer(body, "max_tokens", 1, 1 << 20);
  r.max_tokens = mt ? *mt : mt2 ? *mt2 : o.default_max_tokens;
  r.temperature = number(body, "temperature", 0, 2).value_or(0);
  r.top_p = number(body, "top_p", 0, 1).value_or(1);
  if (r.top_p <= 0) throw bad_request("'top_p' must be > 0", "top_p");
  // Without a seed a sampled request draws a fresh one (OpenAI's and vLLM's: each request its own
  // sample, for self-consistency and pass@k), so no two of them share a generation; greedy ones
  // do not depend on it and keep 0 (identical ones still share).
  const auto seed = integer(body, "seed", INT64_MIN, INT64_MAX);
  r.seed = seed ? static_cast<uint64_t>(*seed) : r.temperature > 0 ? fresh_seed() : 0;
  r.seeded = seed.has_value();
  // OpenAI's: top_logprobs (0 to 20) needs logprobs true.
  r.logprobs = boolean(body, "logprobs").value_or(false);
  const auto top = integer(body, "top_logprobs", 0, 20);
  if (top && !r.logprobs)
    throw bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs");
  r.top_logprobs = top.value_or(0);
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& s = body["stop"];
    if (s.is_string()) {
      r.stop.push_back(s.get<std::string>());
    } else if (s.is_array() && s.size() <= 4) {
      for (const json& x : s) {
        if (!x.is_string()) throw bad_request("'stop' must hold strings", "stop");
        r.stop.push_back(x.get<std::string>());
      }
    } else {
      throw bad_request("'stop' must be a string or an array of up to 4 strings", "stop");
    }
    for (const std::string& x : r.stop)
      if (x.empty()) throw bad_request("'stop' strings must not be empty", "stop");
  }
  r.stream = boolean(body, "stream").value_or(false);
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& so = body["stream_options"];
    if (!so.is_object()) throw bad_request("'stream_options' must be an object", "stream_options");
    for (const auto& [key, v] : so.items())
      if (key != "include_usage")
        throw bad_request("'stream_options." + preview(key) + "' is not supported (include_usage)",
                          "stream_options");
    r.include_usage = boolean(so, "include_usage").value_or(false);
  }
}

// vLLM's per-request video settings, media_io_kwargs: {video: {num_frames | fps}} (what lmms-eval
// sends with pass_video_url=True) and mm_processor_kwargs: {num_frames | fps}; each may be given
// once, in one place.
void read_frame_kwargs(const json& body, const char* field, const char* inner, const ApiOptions& o,
                       ChatRequest& r) {
  if (!body.contains(field) || body[field].is_null()) return;
  const std::string name = field;
  if (!body[field].is_object()) throw bad_request("'" + name + "' must be an object", name);
  json settings = body[field];
  if (inner != nullptr) {
    for (const auto& [key, v] : settings.items())
      if (key != inner)
        throw bad_request("'" + name + "." + preview(key) + "' is not supported (" + inner + ")",
                          name);
    if (!settings.contains(inner) || settings[inner].is_null()) return;
    if (!settings[inner].is_object())
      throw bad_request("'" + name + "." + inner + "' must be an object", name);
    settings = settings[inner];
  }
  for (const auto& [key, v] : settings.items())
    if (key != "num_frames" && key != "fps")
      throw bad_request("'" + name + "." + preview(key) + "' is not supported (num_frames, fps)",
                        name);
  const auto n = integer(settings, "num_frames", 1, o.max_frames);
  const auto f = number(settings, "fps", 0, 1000);
  if ((n && (r.num_frames || r.fps)) || (f && (r.num_frames || r.fps)))
    throw bad_request("frame settings given twice ('" + name + "' and another field): give one",
                      name);
  if (f && *f <= 0) throw bad_request("'" + name + ".fps' must be > 0", name);
  if (n) r.num_frames = n;
  if (f) r.fps = f;
}

void read_media_options(const json& body, const ApiOptions& o, ChatRequest& r) {
  r.fps = number(body, "fps", 0, 1000);
  if (r.fps && *r.fps <= 0) throw bad_request("'fps' must be > 0", "fps");
  r.num_frames = integer(body, "num_frames", 1, o.max_frames);
  if (r.fps && r.num_frames) throw bad_request("give 'fps' or 'num_frames', not both", "fps");
  read_frame_kwargs(body, "media_io_kwargs", "video", o, r);
  read_frame_kwargs(body, "mm_processor_kwargs", nullptr, o, r);
  if (r.fps && r.num_frames)
    throw bad_request("give num_frames or fps, not both", "media_io_kwargs");
  r.start = number(body, "start", 0, 1e9);
  r.end = number(body, "end", 0, 1e9);
  if (r.start && r.end && *r.start >= *r.end)
    throw bad_request("'start' must be before 'end'", "start");
  r.return_prompt_ids = boolean(body, "return_prompt_ids").value_or(false);
  if (body.contains("video_id") && !body["video_id"].is_null()) {
    if (!body["video_id"].is_string() || body["video_id"].get<std::string>().empty())
      throw bad_request("'video_id' must be a non-empty string", "video_id");
    r.video_id = body["video_id"].get<std::string>();
  }
  if (body.contains("user") && !body["user"].is_null() && !body["user"].is_string())
    throw bad_request("'user' must be a string", "user");
}

}  // namespace

namespace {

// The body parsed, its fields checked by `check_fields`, and its model the served one (the head
// of both endpoints' parsers). `text` is emptied: the parsed copy is all that is read after.
json model_request(std::string& text, const ApiOptions& o, void (*check_fields)(const json&)) {
  json body = parse_body(text);  // not const: media_url moves data URLs' base64 out of it
  std::string().swap(text);
  if (!body.is_object())
    throw bad_request("the body must be a JSON object, got " + type_name(body));
  check_fields(body);
  if (!body.contains("model") || !body["model"].is_string())
    throw bad_request("'model' (a string) is required", "model");
  if (body["model"].get<std::string>() != o.model_name)
    throw ApiError(404, "invalid_request_error",
                   "The model '" + preview(body["model"].get<std::string>()) +
                       "' does not exist: this server serves '" + o.model_name + "'",
                   "model", "model_not_found");
  return body;
}

// /v1/completions' prompt: a string, or an array holding one.
std::string completion_prompt(const json& body) {
  if (!body.contains("prompt") || body["prompt"].is_null())
    throw bad_request("'prompt' (a string) is required", "prompt");
  const json* p = &body["prompt"];
  if (p->is_array()) {
    if (p->size() != 1 || !(*p)[0].is_string())
      throw bad_request(
          "'prompt' must be a string or an array of one string: lvx serve completes one prompt "
          "a request (send one request per prompt; token-id prompts are not taken)",
          "prompt");
    p = &(*p)[0];
  }
  if (!p->is_string())
    throw bad_request("'prompt' must be a string, got " + type_name(*p), "prompt");
  const std::string prompt = p->get<std::string>();
  if (prompt.empty()) throw bad_request("'prompt' is empty", "prompt");
  return prompt;
}

// /v1/completions' prompt as content parts (an lvx extension: the chat API's text, video_url and
// image_url parts): the texts before the media into r.prompt, the media into r (one video, or
// consecutive frames), the texts after into r.prompt_after_media; texts joined as they are.
void read_prompt_parts(const json& parts, const ApiOptions& o, ChatRequest& r) {
  bool media = false, after = false;
  for (const json& part : parts) {
    if (const auto t = read_part(part, "user", "prompt", "prompt", o, r)) {
      (media ? r.prompt_after_media : r.prompt) += *t;
      after = after || media;
    } else if (after) {
      throw bad_request(
          "'prompt': its media parts must stand together (one video_url, or the "
          "image_url frames of one video)",
          "prompt");
    } else {
      media = true;
    }
  }
  if (r.video && !r.frames.empty())
    throw bad_request("give a video_url part or image_url frames, not both", "prompt");
  if (static_cast<int64_t>(r.frames.size()) > o.max_frames)
    throw bad_request("at most " + std::to_string(o.max_frames) + " image_url frames, got " +
                          std::to_string(r.frames.size()),
                      "prompt");
  if (!media && r.prompt.empty()) throw bad_request("'prompt' is empty", "prompt");
}

// The legacy API's fields without a counterpart here: refused unless neutral.
void refuse_legacy_fields(json& body) {
  if (boolean(body, "echo").value_or(false))
    throw bad_request("'echo' is not supported: the response holds the completion only", "echo");
  if (body.contains("suffix") && !body["suffix"].is_null())
    throw bad_request("'suffix' is not supported (no insertion)", "suffix");
  if (integer(body, "logprobs", 0, 5).value_or(0) > 0)
    throw bad_request(
        "'logprobs' of /v1/completions (the legacy format) is not supported: ask "
        "/v1/chat/completions with logprobs: true and top_logprobs",
        "logprobs");
  body.erase("logprobs");  // null or 0: read_sampling takes the chat API's boolean
}

}  // namespace

ChatRequest parse_chat_request(std::string text, const ApiOptions& o) {
  json body = model_request(text, o, check_request_fields);
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    throw bad_request("'messages' (a non-empty array) is required", "messages");
  ChatRequest r;
  read_conversation(body["messages"], o, r);
  read_sampling(body, o, r);
  read_media_options(body, o, r);
  return r;
}

ChatRequest parse_completion_request(std::string text, const ApiOptions& o) {
  json body = model_request(text, o, check_completion_fields);
  ChatRequest r;
  r.completion = true;
  const json& prompt = body.contains("prompt") ? body["prompt"] : json();
  if (prompt.is_array() && !prompt.empty() && prompt[0].is_object())
    read_prompt_parts(prompt, o, r);
  else
    r.prompt = completion_prompt(body);
  refuse_legacy_fields(body);
  read_sampling(body, o, r);
  read_media_options(body, o, r);  // the frame settings of a video part, return_prompt_ids, user
  return r;
}

}  // namespace lvx::serve
