// Llama-3.2-Vision's chat template (the release's chat_template; one user turn, or a conversation
// for generation, prompt_chat):
//   <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>…<|image|>QUESTION
//   <|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n[ANSWER<|eot_id|>]
// one <|image|> per frame; the special tokens go in as ids, the user's text never yields one.
// Also the family's stop tokens and its cross_only fine-tuning recipe.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "models/family.h"
#include "models/tokenizer/tokenizer.h"

namespace lvx::models::mllama {

// The ids of a question about `frames` frames and, with `answer`, the answer and <|eot_id|>
// labelled (lvx's unshifted convention, PromptTokens). Errors name the special token the
// tokenizer lacks.
PromptTokens prompt(const Tokenizer& tok, const std::string& question, int64_t frames,
                    const std::string* answer);
// A conversation for generation (Family::prompt_chat): the earlier (question, answer) turns as
// the chat template's user and assistant messages, the frames with the first question, then
// `question` open after the assistant's header. A system message is refused (the release's
// template refuses one in a prompt with images).
PromptTokens prompt_chat(const Tokenizer& tok, const std::string& system,
                         const std::vector<std::pair<std::string, std::string>>& earlier,
                         const std::string& question, int64_t frames);
// The release's rule for a system message in a prompt with images (prompt_chat and the
// family's prompt_turns alike): one that is not blank once trimmed is refused.
void refuse_system(const std::string& system);
// <|eot_id|> (end of the assistant's turn), then <|end_of_text|> (those the tokenizer has;
// <|eot_id|> is required).
std::vector<int64_t> stop_tokens(const Tokenizer& tok);
// freeze.policy cross_only by name alone (Family::trains_cross_only, no configuration): the
// cross layers' cross_attn.* (q/k/v/o projections, q_norm, k_norm), cross_attn_attn_gate,
// cross_attn_mlp_gate, and multi_modal_projector.*. A name alone cannot tell a cross layer's MLP
// from a self layer's; a loaded model (Mllama::trains_cross_only) trains the whole cross layers.
bool trains_cross_only(const std::string& name);

}  // namespace lvx::models::mllama
