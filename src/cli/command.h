// The lvx command table. Each subcommand lives in its own src/cli/cmd_<name>.cpp and registers
// itself with LVX_COMMAND; those files are compiled into the lvx executable directly (not a
// static library), so their registrations are always linked.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace lvx::cli {

struct Command {
  std::string name;
  std::string summary;                      // one line, shown by `lvx --help`
  std::function<int(int, char**)> run;      // argv[0] is the subcommand name
};

std::vector<Command>& command_table();

struct CommandRegistration {
  CommandRegistration(std::string name, std::string summary, std::function<int(int, char**)> run) {
    command_table().push_back({std::move(name), std::move(summary), std::move(run)});
  }
};

}  // namespace lvx::cli

#define LVX_COMMAND(name, summary, fn) \
  static ::lvx::cli::CommandRegistration lvx_command_registration_##fn(name, summary, fn)
