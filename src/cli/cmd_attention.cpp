// `lvx attention`: one exact distributed attention call from a safetensors file on N real ranks.
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/dist/launcher.h"
#include "src/runtime/attention_job.h"

namespace {

int cmd_attention(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx attention --strategy S --nproc N --input in.safetensors --output out.safetensors "
      "[--mask M] [--backward] [--stats stats.json]",
      "Exact distributed attention on N local ranks (or on the ranks of an outer launcher:\n"
      "torchrun / mpirun / lvx launch, when RANK and WORLD_SIZE are set).\n"
      "Input, in global token order: q [B,Sq,Hq,D], k and v [B,Skv,Hkv,D] (Hq % Hkv == 0), with\n"
      "--backward also do (q's shape); media masks need int32 q_media [B,Sq] and kv_media\n"
      "[B,Skv] (-1 = none); an optional bool kv_valid [B,Skv] marks padding keys (false).\n"
      "Output: o [B,Sq,Hq,D], lse [B,Hq,Sq] fp32 (-inf for rows that see no\n"
      "key), and with --backward dq, dk, dv. Causal masks with Sq != Skv align the last query\n"
      "with the last key. Strategies: lv_xattn, ring, striped, ulysses, all_gather, or a\n"
      "forward+backward pair whose backward can start from the forward's saved state\n"
      "(lv_xattn+ring, ring+lv_xattn).");
  p.add_option("strategy", 's', "lv_xattn",
               "lv_xattn | ring | striped | ulysses | all_gather | distflash (causal "
               "self-attention) | F+B (a pair)");
  lvx::cli::add_nproc_options(p, "1", "number of local ranks to start");
  lvx::cli::add_threads_option(p);
  p.add_option("input", 'i', "", "input safetensors file", true);
  p.add_option("output", 'o', "", "output safetensors file (written atomically)", true);
  p.add_option("mask", 'm', "none", "none | causal | media_immediate | media_upto");
  p.add_flag("backward", 'b', "also run backward with the gradient 'do' from the input");
  p.add_option("stats", 0, "", "write per-rank bytes and seconds to this JSON file");
  p.add_option("scale", 0, "0", "softmax scale (0: 1/sqrt(head_dim))");
  p.add_option("repeat", 0, "1", "timed repetitions; stats report the median");
  if (!p.parse(argc, argv)) return 0;
  lvx::runtime::AttentionJob job;
  job.strategy = p.get("strategy");
  job.input = p.get("input");
  job.output = p.get("output");
  job.mask = p.get("mask");
  job.backward = p.flag("backward");
  job.stats = p.get("stats");
  job.scale = p.get_double("scale");
  LVX_CHECK(job.scale >= 0, "--scale must be >= 0 (0: 1/sqrt(head_dim)), got ", job.scale);
  job.repeat = static_cast<int>(p.get_int("repeat", 1, 1000000));

  if (lvx::cli::inside_rank()) {
    lvx::cli::apply_threads(p);
    return lvx::runtime::run_attention_rank(job);
  }

  // Launcher: check everything cheap up front so that bad input fails once, clearly.
  const int nproc = lvx::cli::checked_nproc(p);
  lvx::cli::apply_threads(p, nproc);
  // A FIFO or a directory is refused here; a missing file is named by the input's own check.
  if (std::filesystem::exists(job.input))
    lvx::check_regular_file(job.input, "input file (--input)");
  lvx::check_output_path(job.output, "output file (--output)");
  if (!job.stats.empty()) lvx::check_output_path(job.stats, "stats file (--stats)");
  const auto choice = lvx::attention::strategy_choice_from_name(job.strategy);
  const auto spec = lvx::runtime::validate_attention_input(job);
  lvx::attention::make_strategy(choice.forward)->check_supported(spec, nproc);
  if (job.backward) lvx::attention::make_strategy(choice.backward)->check_supported(spec, nproc);
  std::vector<std::string> cmd{lvx::dist::self_executable()};
  for (int i = 0; i < argc; ++i) cmd.push_back(argv[i]);
  lvx::dist::LaunchOptions o;
  o.nproc = nproc;
  auto r = lvx::dist::launch_local(cmd, o);
  if (r.exit_code != 0) std::filesystem::remove_all(job.output + ".parts");
  return r.exit_code;
}

}  // namespace

LVX_COMMAND("attention", "exact distributed attention from a safetensors file on N ranks",
            cmd_attention);
