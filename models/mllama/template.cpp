#include "models/mllama/template.h"

#include <algorithm>
#include <cctype>

#include "src/common/error.h"

namespace lvx::models::mllama {

namespace {

int64_t special_id(const Tokenizer& tok, const std::string& token) {
  const auto id = tok.token_to_id(token);
  LVX_CHECK(id.has_value(), "the tokenizer has no ", token,
            " token (needed by the Llama-3.2-Vision prompt)");
  return *id;
}

bool blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char ch) { return std::isspace(ch) != 0; });
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace

PromptTokens prompt(const Tokenizer& tok, const std::string& question, int64_t frames,
                    const std::string* answer) {
  LVX_CHECK(!blank(question), "the question is empty");
  LVX_CHECK(frames >= 0, "a prompt's frame count must be >= 0, got ", frames);
  PromptTokens p;
  auto add = [&](const std::vector<int64_t>& ids, bool learn) {
    p.ids.insert(p.ids.end(), ids.begin(), ids.end());
    for (int64_t id : ids) p.labels.push_back(learn ? id : -100);
  };
  // Text (the question, the answer) never yields a special token; the template's own go in as
  // ids. Pieces are encoded between special tokens, as tokenizers splits the chat string there.
  auto text = [&](const std::string& s, bool learn = false) {
    add(tok.encode(s, /*add_special_tokens=*/false, /*split_special_tokens=*/true), learn);
  };
  auto special = [&](const std::string& s, bool learn = false) {
    add({special_id(tok, s)}, learn);
  };
  special("<|begin_of_text|>");
  special("<|start_header_id|>");
  text("user");
  special("<|end_header_id|>");
  if (frames == 0) {  // text only: "\n\n" + the question is one piece of the chat string
    text("\n\n" + question);
  } else {
    text("\n\n");
    for (int64_t f = 0; f < frames; ++f) special("<|image|>");
    text(question);
  }
  special("<|eot_id|>");
  special("<|start_header_id|>");
  text("assistant");
  special("<|end_header_id|>");
  if (answer) {
    // "\n\n" + answer is one piece of the chat string (no special token between them).
    const std::vector<int64_t> head = tok.encode("\n\n", false, true);
    const std::vector<int64_t> both = tok.encode("\n\n" + *answer, false, true);
    if (both.size() > head.size() && std::equal(head.begin(), head.end(), both.begin())) {
      add(head, false);
      add(std::vector<int64_t>(both.begin() + static_cast<int64_t>(head.size()), both.end()), true);
    } else {  // the pre-tokenizer joined them: the whole piece is the answer's
      add(both, true);
    }
    special("<|eot_id|>", true);
  } else {
    text("\n\n");
  }
  // Position t predicts token t + 1.
  p.labels.erase(p.labels.begin());
  p.labels.push_back(-100);
  return p;
}

void refuse_system(const std::string& system) {
  // The release's chat_template raises "Prompting with images is incompatible with system
  // messages." for a system message that is not blank once trimmed (and writes no system header
  // when there are images).
  LVX_CHECK(blank(system),
            "Llama-3.2-Vision's chat template refuses a system message in a prompt with images");
}

PromptTokens prompt_chat(const Tokenizer& tok, const std::string& system,
                         const std::vector<std::pair<std::string, std::string>>& earlier,
                         const std::string& question, int64_t frames) {
  refuse_system(system);
  if (earlier.empty()) return prompt(tok, question, frames, nullptr);
  PromptTokens p = prompt(tok, earlier[0].first, frames, &earlier[0].second);
  auto text = [&](const std::string& s) {
    const std::vector<int64_t> ids = tok.encode(s, /*add_special_tokens=*/false,
                                                /*split_special_tokens=*/true);
    p.ids.insert(p.ids.end(), ids.begin(), ids.end());
  };
  auto special = [&](const std::string& s) { p.ids.push_back(special_id(tok, s)); };
  // Each later message: <|start_header_id|>{role}<|end_header_id|> then "\n\n" + its text as one
  // piece of the chat string, then <|eot_id|>; the last question ends with the assistant's
  // header and "\n\n", as prompt() does.
  for (size_t i = 1; i <= earlier.size(); ++i) {
    const std::string& q = i < earlier.size() ? earlier[i].first : question;
    LVX_CHECK(!blank(q), "the question is empty");
    special("<|start_header_id|>");
    text("user");
    special("<|end_header_id|>");
    text("\n\n" + q);
    special("<|eot_id|>");
    special("<|start_header_id|>");
    text("assistant");
    special("<|end_header_id|>");
    if (i < earlier.size()) {
      text("\n\n" + earlier[i].second);
      special("<|eot_id|>");
    } else {
      text("\n\n");
    }
  }
  p.labels.assign(p.ids.size(), -100);
  return p;
}

std::vector<int64_t> stop_tokens(const Tokenizer& tok) {
  std::vector<int64_t> stop{special_id(tok, "<|eot_id|>")};
  // The release's generation_config eos_token_id: <|end_of_text|>, <|eom_id|>, <|eot_id|>.
  for (const char* t : {"<|end_of_text|>", "<|eom_id|>"})
    if (auto id = tok.token_to_id(t)) stop.push_back(*id);
  return stop;
}

bool trains_cross_only(const std::string& name) {
  if (name.rfind("multi_modal_projector.", 0) == 0) return true;
  if (name.rfind("language_model.model.layers.", 0) != 0) return false;
  return name.find(".cross_attn.") != std::string::npos ||
         ends_with(name, ".cross_attn_attn_gate") || ends_with(name, ".cross_attn_mlp_gate");
}

}  // namespace lvx::models::mllama
