// lvx: entry point. Dispatches to the subcommands registered in src/cli/cmd_*.cpp and turns any
// error into one clear line on stderr and a non-zero exit code.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <unistd.h>

#include "src/cli/command.h"
#include "src/cli/version.h"
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
  std::cout << "usage: lvx <command> [options]   (lvx <command> --help for each; lvx --version)\n\n"
               "lvx runs video multimodal LLMs with distributed cross-attention.\n\ncommands:\n";
  for (const auto& c : table)
    std::cout << "  " << c.name << std::string(c.name.size() < 14 ? 14 - c.name.size() : 1, ' ')
              << c.summary << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  // Large host tensors on transparent huge pages (c10's CPU allocator aligns allocations of 2 MB
  // and more and advises MADV_HUGEPAGE when this is set; read once, at its first allocation):
  // converting a release's bf16 weights to fp32 first-touches gigabytes, and with 4 KB pages the
  // page faults took a third of a 3B model's load and ~8 % of its prefill on this machine. A
  // value the user set is kept.
  ::setenv("THP_MEM_ALLOC_ENABLE", "1", /*overwrite=*/0);
  if (argc >= 2 && (!std::strcmp(argv[1], "--version") || !std::strcmp(argv[1], "version"))) {
    std::cout << lvx::cli::version_text();
    return 0;
  }
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
