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

PromptTokens training_prompt(const models::Family& family, const models::Tokenizer& tok,
                             const QaItem& item, int64_t frames) {
  const std::string target = training_target(item);
  if (item.turns.empty() && item.system.empty())
    return family.prompt(tok, question_text(item), frames, &target);
  std::vector<std::pair<std::string, std::string>> turns{{question_text(item), target}};
  turns.insert(turns.end(), item.turns.begin(), item.turns.end());
  return family.prompt_turns(tok, item.system, turns, frames);
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
