// Read access to a parsed tokenizer.json that names the file and the JSON path in every error
// ("tok.json: model.vocab.x: expected an integer, got ..."), and refuses fields it does not know.
// Internal to models/tokenizer/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>

#include "src/common/error.h"

namespace lvx::models::tokenization {

using json = nlohmann::json;

class Node {
 public:
  Node(const json& j, std::string path, const std::string& file)
      : j_(&j), path_(std::move(path)), file_(&file) {}

  [[noreturn]] void fail(const std::string& what) const {
    LVX_FAIL(*file_, ": ", path_.empty() ? std::string("(top level)") : path_, ": ", what);
  }
  const json& value() const { return *j_; }
  std::string where() const { return *file_ + ": " + path_; }
  bool is_null() const { return j_->is_null(); }
  std::string shown() const {  // the value for messages, shortened
    std::string s = j_->dump();
    return s.size() > 80 ? s.substr(0, 77) + "..." : s;
  }

  // The field, or a null node when absent.
  Node child(const std::string& key) const {
    static const json null_value;
    const auto it = j_->find(key);
    return Node(it == j_->end() ? null_value : *it, join(key), *file_);
  }
  Node required(const std::string& key) const {
    Node n = child(key);
    if (!j_->contains(key)) n.fail("missing required field");
    return n;
  }
  Node item(size_t i) const {
    return Node((*j_)[i], path_ + "[" + std::to_string(i) + "]", *file_);
  }
  size_t size() const { return j_->size(); }

  void expect_object() const {
    if (!j_->is_object()) fail("expected an object, got " + shown());
  }
  void expect_array() const {
    if (!j_->is_array()) fail("expected an array, got " + shown());
  }
  std::string str() const {
    if (!j_->is_string()) fail("expected a string, got " + shown());
    return j_->get<std::string>();
  }
  bool boolean() const {
    if (!j_->is_boolean()) fail("expected true or false, got " + shown());
    return j_->get<bool>();
  }
  int64_t integer() const {
    if (!j_->is_number_integer()) fail("expected an integer, got " + shown());
    return j_->get<int64_t>();
  }
  bool flag(const std::string& key, bool absent) const {
    Node n = child(key);
    return n.is_null() ? absent : n.boolean();
  }
  // Every field must be one we read: an unknown one is named, not ignored.
  void only_fields(std::initializer_list<const char*> known) const {
    for (const auto& [key, v] : j_->items()) {
      if (std::find_if(known.begin(), known.end(), [&](const char* k) { return key == k; }) ==
          known.end()) {
        child(key).fail("unsupported field (value " + child(key).shown() + ")");
      }
    }
  }
  std::string type() const {
    expect_object();
    return required("type").str();
  }

 private:
  std::string join(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }
  const json* j_;
  std::string path_;
  const std::string* file_;
};

}  // namespace lvx::models::tokenization
