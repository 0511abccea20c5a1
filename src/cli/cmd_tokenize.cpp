// `lvx tokenize`: text → ids (or ids → text with --decode) with a tokenizer.json
// (models/tokenizer/tokenizer.h), for checking prompts and for scripts.
#include <iostream>
#include <sstream>

#include "models/tokenizer/tokenizer.h"
#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/common/files.h"

namespace {

int cmd_tokenize(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx tokenize --tokenizer tokenizer.json (--text T | --file F) [--decode] [options]",
      "Encode UTF-8 text into token ids, printed on one line separated by spaces, or with "
      "--decode\n"
      "read ids (separated by spaces, commas or newlines) and print the text. Byte-level BPE\n"
      "tokenizer.json files of the Qwen2 and GPT-NeoX families (models/tokenizer/tokenizer.h).");
  p.add_option("tokenizer", 't', "", "tokenizer.json", true);
  p.add_option("text", 0, "", "the input on the command line");
  p.add_option("file", 'f', "", "read the input from this file (\"-\": standard input)");
  p.add_flag("decode", 'd', "the input is ids: print their text");
  p.add_flag("special", 's',
             "encode: add the post-processor's special tokens; decode: skip special tokens");
  p.add_flag("tokens", 0, "encode: print one line per token, id and token string");
  p.add_flag("split-special", 0,
             "encode: special tokens written in the text are plain text (as lvx does for "
             "questions and answers)");
  if (!p.parse(argc, argv)) return 0;
  const bool has_text = !p.get("text").empty(), has_file = !p.get("file").empty();
  LVX_CHECK(has_text != has_file, "give exactly one of --text and --file");
  std::string input = p.get("text");
  if (has_file) {
    if (p.get("file") == "-") {
      std::ostringstream s;
      s << std::cin.rdbuf();
      input = s.str();
    } else {  // a regular file (a FIFO or a directory is refused), at most 1 GiB
      input = lvx::read_file(p.get("file"), "--file");
    }
  }
  const auto tok = lvx::models::Tokenizer::from_file(p.get("tokenizer"));
  if (p.flag("decode")) {
    for (char& c : input)
      if (c == ',') c = ' ';
    std::istringstream in(input);
    std::vector<int64_t> ids;
    std::string word;
    while (in >> word) {
      size_t used = 0;
      int64_t id = -1;
      try {
        id = std::stoll(word, &used);
      } catch (const std::exception&) {
      }
      LVX_CHECK(used == word.size() && id >= 0, "--decode: '", word, "' is not a token id");
      ids.push_back(id);
    }
    std::cout << tok.decode(ids, p.flag("special")) << "\n";
    return 0;
  }
  const auto ids = tok.encode(input, p.flag("special"), p.flag("split-special"));
  if (p.flag("tokens")) {
    for (int64_t id : ids) std::cout << id << "\t" << tok.id_to_token(id) << "\n";
    return 0;
  }
  for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
  std::cout << "\n";
  return 0;
}

}  // namespace

LVX_COMMAND("tokenize", "encode text to token ids, or decode ids, with a tokenizer.json",
            cmd_tokenize);
