// Post-processors; see post_processor.h.
#include "models/tokenizer/post_processor.h"

#include <map>
#include <string>
#include <utility>

namespace lvx::models::tokenization {
namespace {

void parse_template(const Node& pieces, bool is_pair,
                    const std::map<std::string, std::vector<int64_t>>& specials,
                    std::vector<std::optional<std::vector<int64_t>>>* out) {
  pieces.expect_array();
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Node piece = pieces.item(i);
    piece.expect_object();
    if (piece.value().contains("Sequence")) {
      piece.only_fields({"Sequence"});
      const Node seq = piece.child("Sequence");
      seq.expect_object();
      seq.only_fields({"id", "type_id"});
      const std::string id = seq.required("id").str();
      if (id != "A" && !(is_pair && id == "B")) {
        seq.child("id").fail("unsupported sequence id " + seq.child("id").shown() +
                             (is_pair ? " (A or B)" : " (a single template has only A)"));
      }
      seq.required("type_id").integer();
      if (out) out->push_back(std::nullopt);
    } else if (piece.value().contains("SpecialToken")) {
      piece.only_fields({"SpecialToken"});
      const Node sp = piece.child("SpecialToken");
      sp.expect_object();
      sp.only_fields({"id", "type_id"});
      const std::string name = sp.required("id").str();
      const auto it = specials.find(name);
      if (it == specials.end()) {
        sp.child("id").fail("special token " + json(name).dump() +
                            " is not in post_processor.special_tokens");
      }
      sp.required("type_id").integer();
      if (out) out->push_back(it->second);
    } else {
      piece.fail("expected {\"Sequence\": ...} or {\"SpecialToken\": ...}, got " + piece.shown());
    }
  }
}

}  // namespace

std::vector<int64_t> PostProcessor::apply(const std::vector<int64_t>& ids) const {
  std::vector<int64_t> out;
  for (const auto& piece : single) {
    const std::vector<int64_t>& add = piece ? *piece : ids;
    out.insert(out.end(), add.begin(), add.end());
  }
  return out;
}

void parse_post_processor(const Node& n, const std::function<bool(int64_t)>& known,
                          std::vector<PostProcessor>* out) {
  if (n.is_null()) return;
  const std::string type = n.type();
  if (type == "Sequence") {
    n.only_fields({"type", "processors"});
    const Node list = n.required("processors");
    list.expect_array();
    for (size_t i = 0; i < list.size(); ++i) parse_post_processor(list.item(i), known, out);
  } else if (type == "ByteLevel") {  // only trims offsets: no ids change
    n.only_fields({"type", "add_prefix_space", "trim_offsets", "use_regex"});
  } else if (type == "TemplateProcessing") {
    n.only_fields({"type", "single", "pair", "special_tokens"});
    std::map<std::string, std::vector<int64_t>> specials;
    const Node st = n.required("special_tokens");
    st.expect_object();
    for (const auto& [name, v] : st.value().items()) {
      const Node s = st.child(name);
      s.expect_object();
      s.only_fields({"id", "ids", "tokens"});
      const Node ids = s.required("ids");
      ids.expect_array();
      std::vector<int64_t> list;
      for (size_t i = 0; i < ids.size(); ++i) {
        const int64_t id = ids.item(i).integer();
        if (!known(id)) {
          ids.item(i).fail("id " + std::to_string(id) + " of special token " + json(name).dump() +
                           " is not in the vocabulary");
        }
        list.push_back(id);
      }
      const Node tokens = s.required("tokens");
      tokens.expect_array();
      if (tokens.size() != ids.size()) s.fail("ids and tokens differ in length");
      specials[name] = std::move(list);
    }
    PostProcessor p;
    parse_template(n.required("single"), false, specials, &p.single);
    if (!n.child("pair").is_null()) parse_template(n.child("pair"), true, specials, nullptr);
    out->push_back(std::move(p));
  } else {
    n.child("type").fail("unsupported post-processor \"" + type +
                         "\" (supported: ByteLevel, TemplateProcessing, Sequence)");
  }
}

}  // namespace lvx::models::tokenization
