// `lvx finetune`: supervised fine-tuning of a video LLM on question-answer rows, sequence
// parallel across N local ranks (or the ranks of torchrun / mpirun / lvx launch).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "models/family.h"
#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/runtime/device.h"
#include "src/runtime/finetune_job.h"

namespace {

// The progress bar on a terminal: drawn by the launching process from rank 0's metrics file
// (rank output goes through the launcher's line prefixer, which cannot carry a redrawn line).
void draw_bar(const std::string& metrics, std::streamoff* offset, std::string* last) {
  std::ifstream f(metrics);
  if (!f.good()) return;
  f.seekg(*offset);
  std::string line;
  while (std::getline(f, line)) {
    if (f.eof()) break;  // a line still being written
    *offset = f.tellg();
    try {
      const auto m = nlohmann::json::parse(line);
      if (m.contains("eval_loss")) {  // an evaluation (src/runtime/finetune_eval.h)
        std::string acc;
        if (m.contains("eval_accuracy"))
          acc = lvx::str(", accuracy ", m.at("eval_correct").get<int64_t>(), "/",
                         m.at("eval_scored").get<int64_t>());
        std::fprintf(stderr, "\neval after step %lld: loss %.4f over %lld rows%s\n",
                     static_cast<long long>(m.at("step").get<int64_t>()),
                     m.at("eval_loss").get<double>(),
                     static_cast<long long>(m.at("eval_rows").get<int64_t>()), acc.c_str());
        continue;
      }
      const int64_t step = m.at("step"), total = m.at("total_steps");
      const int width = 24, full = static_cast<int>(width * step / std::max<int64_t>(1, total));
      const int64_t eta = static_cast<int64_t>(m.at("eta_seconds").get<double>());
      char buf[256];
      std::snprintf(buf, sizeof(buf),
                    "\r[%s%s] step %lld/%lld  loss %.4f  %.0f tok/s  ETA %lld:%02lld:%02lld ",
                    std::string(static_cast<size_t>(full), '#').c_str(),
                    std::string(static_cast<size_t>(width - full), '.').c_str(),
                    static_cast<long long>(step), static_cast<long long>(total),
                    m.at("loss").get<double>(), m.at("tokens_per_second").get<double>(),
                    static_cast<long long>(eta / 3600), static_cast<long long>(eta / 60 % 60),
                    static_cast<long long>(eta % 60));
      *last = buf;
      std::fputs(buf, stderr);
      std::fflush(stderr);
    } catch (const std::exception&) {
    }
  }
}

// Dotted overrides ("optimizer.lr=1e-3") are the arguments that are not flags; the others
// (argv[0] first) go to the parser.
void split_overrides(int argc, char** argv, std::vector<std::string>* overrides,
                     std::vector<char*>* args) {
  static const std::regex kOverride("^[A-Za-z_]+(\\.[A-Za-z_]+)?=.*");
  for (int i = 0; i < argc; ++i) {
    if (i > 0 && std::regex_match(argv[i], kOverride))
      overrides->push_back(argv[i]);
    else
      args->push_back(argv[i]);
  }
}

// The options of `lvx finetune`, with its usage and description.
lvx::cli::ArgParser finetune_parser() {
  lvx::cli::ArgParser p(
      "lvx finetune --config run.yaml [--resume [--accept-config-changes]] [--nproc N] "
      "[--sp-size S] [section.field=value | section={field: value} ...]",
      "Fine-tunes a video LLM (a checkpoint directory; model_type " +
          lvx::models::supported_model_types() +
          ") on JSONL rows\nof video, optional start/end seconds, question and answer; "
          "the loss is on the answer tokens.\n"
          "AdamW (fp32 masters), warm-up then cosine decay, gradient clipping and accumulation,\n"
          "freeze policies (vision | cross_only | none), data x sequence parallel across ranks,\n"
          "sharded training state (parallel.shard: none | optimizer | gradients | parameters),\n"
          "LoRA (lora: {r, alpha, target_modules}), evaluation on held-out rows (eval: {data,\n"
          "every, accuracy, best_metric}: loss, lvx qa's accuracy, the best checkpoint kept),\n"
          "TensorBoard event files (logging.tensorboard).\n"
          "Checkpoints (checkpoint.dir/step-N, `latest`) load with lvx qa / lvx forward; --resume\n"
          "continues from the latest. See docs/finetune.md for every config field.");
  p.add_option("config", 'c', "", "run YAML (configs/runs/finetune_tiny.yaml)", true);
  p.add_flag("resume", 'r', "continue from checkpoint.dir/latest (a fresh start when none)");
  p.add_flag("accept-config-changes", 0,
             "with --resume: continue although data, optimizer, schedule, freeze or lora settings "
             "differ from the checkpoint's (refused otherwise, naming the fields)");
  p.add_option("nproc", 'n', "", "local ranks to start (default: parallel.nproc)");
  p.add_option("sp-size", 0, "",
               "ranks per sequence-parallel group (default: parallel.sp_size; 0: all ranks)");
  lvx::cli::add_threads_option(p);
  lvx::cli::add_device_option(p);
  return p;
}

// The job of the parsed command line: the dotted overrides, then --nproc and --sp-size as
// overrides of parallel.nproc and parallel.sp_size.
lvx::runtime::FinetuneJob finetune_job(const lvx::cli::ArgParser& p,
                                       const std::vector<std::string>& overrides) {
  lvx::runtime::FinetuneJob job;
  job.config = p.get("config");
  job.resume = p.flag("resume");
  job.accept_config_changes = p.flag("accept-config-changes");
  job.device = p.get("device");
  job.overrides = overrides;
  if (p.has("nproc") && !p.get("nproc").empty())
    job.overrides.push_back("parallel.nproc=" + p.get("nproc"));
  if (p.has("sp-size") && !p.get("sp-size").empty())
    job.overrides.push_back("parallel.sp_size=" + p.get("sp-size"));
  return job;
}

// The drawing thread's loop: redraws the bar from the metrics lines written after it started,
// every 300 ms while `running`, then once more, ending the bar's line if one was drawn.
void draw_bar_until_done(const std::string& metrics, const std::atomic<bool>& running) {
  std::streamoff offset = 0;
  {
    std::ifstream f(metrics, std::ios::ate);
    if (f.good()) offset = f.tellg();
  }
  std::string last;
  while (running) {
    draw_bar(metrics, &offset, &last);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  draw_bar(metrics, &offset, &last);
  if (!last.empty()) std::fputs("\n", stderr);
}

// The launching process: starts the local ranks (this executable with the same arguments) and,
// on a terminal, draws rank 0's progress bar until they exit. Returns their exit code.
int launch_finetune(int argc, char** argv, const lvx::runtime::FinetuneJob& job,
                    const lvx::runtime::TrainConfig& cfg) {
  std::vector<std::string> cmd{lvx::dist::self_executable()};
  for (int i = 0; i < argc; ++i) cmd.push_back(argv[i]);
  lvx::dist::LaunchOptions o;
  o.nproc = lvx::cli::check_nproc(cfg.parallel.nproc, false, "parallel.nproc (--nproc)");
  lvx::runtime::check_local_devices(job.device, o.nproc);
  const bool bar = ::isatty(STDERR_FILENO);
  if (bar) o.env["LVX_FINETUNE_BAR"] = "1";
  std::atomic<bool> running{true};
  std::thread drawer;
  if (bar) drawer = std::thread([&] { draw_bar_until_done(cfg.logging.metrics, running); });
  const int rc = lvx::dist::launch_local(cmd, o).exit_code;
  running = false;
  if (drawer.joinable()) drawer.join();
  return rc;
}

int cmd_finetune(int argc, char** argv) {
  std::vector<std::string> overrides;
  std::vector<char*> args;
  split_overrides(argc, argv, &overrides, &args);
  lvx::cli::ArgParser p = finetune_parser();
  if (!p.parse(static_cast<int>(args.size()), args.data())) return 0;
  const lvx::runtime::FinetuneJob job = finetune_job(p, overrides);
  if (lvx::cli::inside_rank())
    return lvx::cli::apply_threads(p), lvx::runtime::run_finetune_rank(job);
  // Bad input fails once, clearly, before ranks start and before anything is written.
  const lvx::runtime::TrainConfig cfg = lvx::runtime::validate_finetune_job(job);
  return launch_finetune(argc, argv, job, cfg);
}

}  // namespace

LVX_COMMAND("finetune", "fine-tune a video LLM on question-answer rows (sequence parallel)",
            cmd_finetune);
