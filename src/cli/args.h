// Command-line parsing for lvx subcommands: long and short flags, defaults shown in --help, and an
// environment mirror for each option (LVX_<NAME>, e.g. --master-port ↔ LVX_MASTER_PORT) that
// replaces the default but not an explicit flag. Arguments after "--" are kept verbatim.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace lvx::cli {

class ArgParser {
 public:
  ArgParser(std::string usage, std::string description);

  // A valued option. `default_value` is shown in --help; empty means "no default".
  void add_option(const std::string& name, char short_name, const std::string& default_value,
                  const std::string& help, bool required = false);
  // A boolean switch (present = true).
  void add_flag(const std::string& name, char short_name, const std::string& help);

  // Parses argv[first..argc). Returns false when --help was printed (the caller exits 0).
  // Throws lvx::Error naming the unknown flag, a missing value, or a missing required option.
  bool parse(int argc, char** argv, int first = 1);

  bool has(const std::string& name) const;  // given on the command line, env, or has a default
  std::string get(const std::string& name) const;
  // Integers must fit int64 (an error naming the flag otherwise); the bounded form also checks
  // lo <= value <= hi. Numbers must be finite: nan and inf are refused for every flag.
  int64_t get_int(const std::string& name) const;
  int64_t get_int(const std::string& name, int64_t lo, int64_t hi) const;
  double get_double(const std::string& name) const;
  bool flag(const std::string& name) const;
  std::vector<int64_t> get_int_list(const std::string& name) const;  // "1,2,4"
  std::vector<std::string> get_list(const std::string& name) const;  // "a,b"
  const std::vector<std::string>& rest() const { return rest_; }
  std::string help() const;

 private:
  struct Spec {
    std::string name;
    char short_name;
    std::string default_value;
    std::string help;
    bool required;
    bool is_flag;
  };
  const Spec* find(const std::string& name) const;
  std::string usage_, description_;
  std::vector<Spec> specs_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> rest_;
};

// Ranks and threads, one rule for every command that computes.
//
// --nproc: at most kMaxRanksPerCore × the cores this process may use (a typo such as 1000 would
// start 1000 ranks); --force-nproc lifts the bound. Declared by add_nproc_options (with the
// command's own default and help), read by checked_nproc.
constexpr int kMaxRanksPerCore = 4;
// Removes option `name` (--name V, --name=V, -s V) from a rank command line and hands its value
// to the ranks by environment (the option's env name, LVX_<NAME>) instead: a value resolved once
// in the launching process (a run folder's latest checkpoint) reaches every rank alike, and a
// secret (an API key) stays out of the process list.
void pin_option_for_ranks(std::vector<std::string>& cmd, const std::string& name, char short_name,
                          const std::string& value);

void add_nproc_options(ArgParser& p, const std::string& default_value, const std::string& help);
int checked_nproc(const ArgParser& p);

// Whether this process is one rank of a launched job (WORLD_SIZE set, or OMPI_COMM_WORLD_SIZE
// under mpirun): a command then runs its rank's part instead of launching.
bool inside_rank();
// A model job (forward, qa) on `nproc` local ranks: this command line again, its --model and
// --adapter pinned to what the launcher resolved (a hub name or relative path means the same on
// every rank); rank0_direct: rank 0 writes the launcher's stdout itself. The launch's exit code.
int launch_model_job(int argc, char** argv, int nproc, const std::string& model,
                     const std::string& adapter, bool rank0_direct);
// The same bound for a rank count from elsewhere (a config file): `what` names it.
int check_nproc(int64_t n, bool force, const std::string& what = "--nproc");

// --threads: intra-op (libtorch) threads of each rank; default "auto" = cores ÷ local ranks, for
// one rank too (libtorch's own default oversubscribes a shared machine), or OMP_NUM_THREADS when
// set. apply_threads sets them in this process: on a rank LOCAL_WORLD_SIZE counts the local
// ranks, in a launcher `local_ranks`. Returns the count.
void add_threads_option(ArgParser& p);
int apply_threads(const ArgParser& p, int local_ranks = 1);
// The ranks on this machine: LOCAL_WORLD_SIZE (torchrun, lvx's launcher) or
// OMPI_COMM_WORLD_LOCAL_SIZE (mpirun) on a rank, else `local_ranks` (a launcher's own count).
int local_rank_count(int local_ranks);
// --decode-ranks one|all (default one): whether a generation stepped alone decodes on rank 0
// with the other ranks answering at the cross layers (models/lead_decode.h), or on every rank.
// One option, the same help, for qa and forward --generate. decode_on_lead reads it (true: one).
void add_decode_ranks_option(ArgParser& p);
bool decode_on_lead(const ArgParser& p);
// The threads of every local rank together (threads × local ranks, at most the cores this
// process may use): what rank 0 decodes on while the others wait (models/lead_decode.h).
int host_threads(int threads);
// --max-batch-visual-keys: with --max-batch-tokens, a prefill chunk also ends before its tokens'
// visual key reads pass this many (runtime::GenerateOptions::prefill_chunk_keys; default 0: no
// bound). One option for serve, qa and forward, so that lvx qa given the server's two values
// cuts the server's chunks.
void add_chunk_keys_option(ArgParser& p);
int64_t chunk_keys(const ArgParser& p);
// --device auto|cuda|cpu (default auto): where each rank's tensors live, chosen on the rank by
// runtime::choose_device (src/runtime/device.h): cuda:LOCAL_RANK when CUDA devices are visible,
// else cpu; fewer GPUs than local ranks is refused. One option, the same help, for every command.
void add_device_option(ArgParser& p);

// The cores this process may run on (CPU affinity, bounded by a cgroup CPU quota).
int available_cores();

}  // namespace lvx::cli
