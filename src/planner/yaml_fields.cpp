#include "src/planner/yaml_fields.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "src/common/error.h"
#include "src/common/files.h"

namespace lvx::planner {

YamlMap::YamlMap(YAML::Node node, std::string file, std::string path)
    : node_(std::move(node)), file_(std::move(file)), path_(std::move(path)) {
  LVX_CHECK(node_.IsMap(), file_, ": ", path_.empty() ? std::string("top level") : path_,
            ": expected a mapping");
}

std::string YamlMap::where(const std::string& key) const {
  return path_.empty() ? file_ + ": " + key : file_ + ": " + path_ + "." + key;
}

bool YamlMap::has(const std::string& key) const { return static_cast<bool>(node_[key]); }

YAML::Node YamlMap::child(const std::string& key) const {
  used_.insert(key);
  YAML::Node n = node_[key];
  LVX_CHECK(n && !n.IsNull(), where(key), ": missing");
  return n;
}

std::string YamlMap::get_string(const std::string& key) const {
  YAML::Node n = child(key);
  LVX_CHECK(n.IsScalar(), where(key), ": expected a string");
  return n.as<std::string>();
}

int64_t YamlMap::get_int(const std::string& key) const {
  YAML::Node n = child(key);
  int64_t v = 0;
  try {
    LVX_CHECK(n.IsScalar(), where(key), ": expected an integer");
    v = n.as<int64_t>();
  } catch (const YAML::Exception&) {
    LVX_FAIL(where(key), ": expected an integer, got '", n.Scalar(), "'");
  }
  LVX_CHECK(v > 0, where(key), ": expected > 0, got ", v);
  return v;
}

double YamlMap::get_double(const std::string& key) const {
  YAML::Node n = child(key);
  double v = 0;
  try {
    LVX_CHECK(n.IsScalar(), where(key), ": expected a number");
    v = n.as<double>();
  } catch (const YAML::Exception&) {
    LVX_FAIL(where(key), ": expected a number, got '", n.Scalar(), "'");
  }
  LVX_CHECK(std::isfinite(v) && v > 0, where(key), ": expected a finite number > 0, got ", v);
  return v;
}

int64_t YamlMap::get_int_or(const std::string& key, int64_t fallback) const {
  if (!has(key)) {
    used_.insert(key);
    return fallback;
  }
  return get_int(key);
}

std::string YamlMap::get_string_or(const std::string& key, const std::string& fallback) const {
  if (!has(key)) {
    used_.insert(key);
    return fallback;
  }
  return get_string(key);
}

YamlMap YamlMap::get_map(const std::string& key) const {
  YAML::Node n = child(key);
  LVX_CHECK(n.IsMap(), where(key), ": expected a mapping");
  return YamlMap(n, file_, path_.empty() ? key : path_ + "." + key);
}

std::vector<YamlMap> YamlMap::get_map_list(const std::string& key) const {
  YAML::Node n = child(key);
  LVX_CHECK(n.IsSequence() && n.size() > 0, where(key), ": expected a non-empty list");
  std::vector<YamlMap> out;
  for (size_t i = 0; i < n.size(); ++i) {
    std::string p = (path_.empty() ? key : path_ + "." + key) + "[" + std::to_string(i) + "]";
    LVX_CHECK(n[i].IsMap(), file_, ": ", p, ": expected a mapping");
    out.emplace_back(n[i], file_, p);
  }
  return out;
}

void YamlMap::finish() const {
  std::string known;
  for (const auto& k : used_) known += (known.empty() ? "" : ", ") + k;
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    std::string key = it->first.as<std::string>();
    LVX_CHECK(used_.count(key) > 0, where(key), ": unknown field (known: ", known, ")");
  }
}

namespace {

constexpr uint64_t kMaxConfigBytes = uint64_t{1} << 20;  // a model or cluster config: a few KB

// yaml-cpp parses nested collections recursively with no bound: a file of 100k '[' overflows the
// stack. Flow collections ([ ], { }) are counted here (outside quotes and comments); block
// nesting is bounded by the file size (k levels need ~k²/2 bytes of indentation: < 1,500 in 1 MiB).
void check_flow_depth(const std::string& text, const std::string& file) {
  int depth = 0, max_depth = 0;
  char quote = 0;
  bool comment = false;
  int64_t line = 1;
  for (char ch : text) {
    if (ch == '\n') {
      ++line;
      comment = false;
      continue;
    }
    if (comment) continue;
    if (quote) {
      if (ch == quote) quote = 0;
      continue;
    }
    if (ch == '"' || ch == '\'') {
      quote = ch;
    } else if (ch == '#') {
      comment = true;
    } else if (ch == '[' || ch == '{') {
      max_depth = std::max(max_depth, ++depth);
      LVX_CHECK(max_depth <= kMaxJsonDepth, file, ":", line, ": collections nest deeper than ",
                kMaxJsonDepth, " levels");
    } else if ((ch == ']' || ch == '}') && depth > 0) {
      --depth;
    }
  }
}

}  // namespace

YamlMap load_yaml_map(const std::string& file) {
  // Read through the checked reader (a FIFO, a directory or a huge file is refused at once, not
  // blocked on or read whole), then parse the text.
  LVX_CHECK(std::filesystem::exists(file), file, ": cannot open (no such file)");
  const std::string text = read_file(file, "config file", kMaxConfigBytes);
  check_flow_depth(text, file);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    LVX_FAIL(file, ": invalid YAML: ", e.what());
  }
  return YamlMap(root, file, "");
}

}  // namespace lvx::planner
