// lvx: entry point. Dispatches to the subcommands registered in src/cli/cmd_*.cpp and turns any
// error into one clear line on stderr and a non-zero exit code.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <unistd.h>

#include "src/cli/command.h"
#include "src/common/error.h"

namespace lvx::cli {

std::vector<Command>& command_table() {
  static std::vector<Command> table;
  return table;
}


}  // namespace lvx::cli

namespace {

void print_help() {
  auto table = lvx::cli::command_table();
  std::sort(table.begin(), table.end(), [](auto& a, auto& b) { return a.name < b.name; });
  std::cout << "usage: lvx <command> [options]   (lvx <command> --help for each)\n\n"
               "lvx runs video multimodal LLMs with distributed cross-attention.\n\ncommands:\n";
  for (const auto& c : table)
    std::cout << "  " << c.name << std::string(c.name.size() < 14 ? 14 - c.name.size() : 1, ' ')
              << c.summary << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    print_help();
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : lvx::cli::command_table()) {
    if (c.name != argv[1]) continue;
    try {
      return c.run(argc - 1, argv + 1);
    } catch (const lvx::Error& e) {
      std::cerr << "lvx " << c.name << ": error: " << e.what() << std::endl;
    } catch (const c10::Error& e) {
      std::cerr << "lvx " << c.name << ": error: " << e.what_without_backtrace() << std::endl;
    } catch (const std::exception& e) {
      std::cerr << "lvx " << c.name << ": error: " << e.what() << std::endl;
    }
    return 1;
  }
  std::cerr << "lvx: unknown command '" << argv[1] << "' (see lvx --help)\n";
  return 2;
}
