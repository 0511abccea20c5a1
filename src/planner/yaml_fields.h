// Strict YAML field access for lvx configs: every read names the file and the field path, and a
// mapping's fields not read by the loader are reported as unknown ("configs/models/x.yaml:
// layers[3].heads: missing", "...: layers[0].head: unknown field (known: heads, kv_heads, ...)").
#pragma once

#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace lvx::planner {

// One mapping of a config being read. Call the getters for every documented field, then
// finish(), which throws on any field that was not asked for.
class YamlMap {
 public:
  YamlMap(YAML::Node node, std::string file, std::string path);

  std::string get_string(const std::string& key) const;
  int64_t get_int(const std::string& key) const;    // integer, > 0 unless allow_zero
  double get_double(const std::string& key) const;  // finite, > 0
  int64_t get_int_or(const std::string& key, int64_t fallback) const;
  std::string get_string_or(const std::string& key, const std::string& fallback) const;
  bool has(const std::string& key) const;
  YamlMap get_map(const std::string& key) const;
  // The elements of a sequence field, each a mapping.
  std::vector<YamlMap> get_map_list(const std::string& key) const;
  // Throws naming the first field present in the file but never requested.
  void finish() const;

  // "file: path.key" for messages.
  std::string where(const std::string& key) const;

 private:
  YAML::Node child(const std::string& key) const;
  YAML::Node node_;
  std::string file_, path_;
  mutable std::set<std::string> used_;
};

// Loads a YAML file whose top level is a mapping; errors name the file.
YamlMap load_yaml_map(const std::string& file);

}  // namespace lvx::planner
