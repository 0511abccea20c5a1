// `lvx qa`: answers questions about videos with a checkpoint on N ranks (src/runtime/qa_job.h).
#include <cstdint>
#include <cstdlib>

#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/dist/launcher.h"
#include "src/runtime/device.h"
#include "src/runtime/qa_job.h"
#include "src/runtime/question_plan.h"
#include "src/runtime/train_checkpoint.h"

namespace {

// The options of lvx qa.
void add_qa_options(lvx::cli::ArgParser& p) {
  p.add_option("model", 'm', "", "checkpoint directory (config.json, weights, tokenizer.json)",
               true);
  p.add_option("adapter", 0, "",
               "LoRA adapter directory in PEFT's layout (adapter_config.json, "
               "adapter_model.safetensors), merged into the weights once");
  p.add_option("video", 'v', "", "video file (one question)");
  p.add_option("question", 'q', "", "the question (one question)");
  p.add_option("options", 0, "", "multiple-choice options, '|'-separated (one question)");
  p.add_option("questions", 0, "", "JSONL file of questions (batch mode)");
  p.add_option("output", 'o', "", "JSONL file of answers (batch mode)");
  p.add_option("fps", 0, "", "sample this many frames per second");
  p.add_option("num-frames", 'f', "", "sample N frames spread over the range (default 16)");
  p.add_option("start", 0, "", "range start, seconds");
  p.add_option("end", 0, "", "range end, seconds (exclusive)");
  lvx::cli::add_nproc_options(
      p, "1",
      "local ranks to start; auto: the count whose priced question (the planner's prefill and\n"
      "decode prices on --cluster) ends soonest, printed with each count's price");
  lvx::cli::add_threads_option(p);
  p.add_option("max-new-tokens", 't', "64", "most tokens to generate");
  p.add_option("max-batch-tokens", 0, "0",
               "prefill the prompt in chunks of at most this many tokens, as lvx serve does\n"
               "(the same value gives the server's answer bit for bit; 0: whole)");
  lvx::cli::add_chunk_keys_option(p);
  p.add_option("temperature", 0, "0", "0: greedy (deterministic); > 0: sampling");
  p.add_option("top-p", 0, "1", "nucleus sampling threshold (with --temperature > 0)");
  p.add_option("seed", 0, "0", "sampling seed (the same seed gives the same answer)");
  p.add_option("strategies", 's', "auto", "auto | S | S_cross,S_self (prefill)");
  p.add_option("cluster", 'c', "", "cluster config for --strategies auto (lvx calibrate)");
  p.add_option("dtype", 0, "auto",
               "fp32 | bf16 | auto (the checkpoint's where the device computes it natively: bf16 "
               "on a GPU and on CPUs with AMX or AVX512-BF16, else fp32)");
  lvx::cli::add_device_option(p);
  lvx::cli::add_decode_ranks_option(p);
  p.add_flag("json", 'j', "print one JSON object (answer, timings, bytes) per question");
  p.add_flag("print-plan", 0, "print each question's per-layer strategies (stderr)");
  p.add_flag("ignore-stop", 0,
             "generate --max-new-tokens tokens, stopping only at the model's context (benchmarks)");
  p.add_flag("overwrite", 0,
             "batch: answer every question again into an --output written with other settings "
             "(the old answers move to <output>.old)");
}

// The job the parsed options ask for.
lvx::runtime::QaJob qa_job_of(const lvx::cli::ArgParser& p) {
  lvx::runtime::QaJob job;
  // A run folder means its latest checkpoint, resolved once here for every rank.
  job.model = lvx::runtime::follow_run_folder(p.get("model"));
  job.adapter = p.get("adapter").empty() ? "" : lvx::runtime::follow_run_folder(p.get("adapter"));
  job.video = p.get("video");
  job.question = p.get("question");
  for (size_t b = 0, e; !p.get("options").empty() && b <= p.get("options").size(); b = e + 1) {
    e = p.get("options").find('|', b);
    if (e == std::string::npos) e = p.get("options").size();
    job.options.push_back(p.get("options").substr(b, e - b));
  }
  job.questions = p.get("questions");
  job.output = p.get("output");
  if (!p.get("fps").empty()) job.fps = p.get_double("fps");
  if (!p.get("num-frames").empty()) job.num_frames = p.get_int("num-frames");
  if (!p.get("start").empty()) job.start = p.get_double("start");
  if (!p.get("end").empty()) job.end = p.get_double("end");
  job.generation.max_new_tokens = p.get_int("max-new-tokens");
  job.generation.prefill_chunk = p.get_int("max-batch-tokens", 0, INT32_MAX);
  job.generation.prefill_chunk_keys = lvx::cli::chunk_keys(p);
  job.generation.sampling.temperature = p.get_double("temperature");
  job.generation.sampling.top_p = p.get_double("top-p");
  job.generation.sampling.seed = static_cast<uint64_t>(p.get_int("seed", 0, INT64_MAX));
  job.plan.strategies = p.get("strategies");
  job.plan.cluster = p.get("cluster");
  job.plan.dtype = p.get("dtype");
  job.device = p.get("device");
  job.json = p.flag("json");
  job.print_plan = p.flag("print-plan");
  job.ignore_stop = p.flag("ignore-stop");
  job.overwrite = p.flag("overwrite");
  job.lead_decode = lvx::cli::decode_on_lead(p);
  return job;
}

// The most ranks --nproc auto considers: one per GPU where the job runs on GPUs, else one per
// core.
int most_ranks(const lvx::runtime::QaJob& job) {
  const int gpus = lvx::runtime::cuda_device_count();
  if (job.device != "cpu" && gpus > 0) return gpus;
  return lvx::cli::available_cores();
}

int cmd_qa(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx qa --model DIR --video V --question Q [--fps F | --num-frames N] [--start S --end E]\n"
      "       [--nproc N] [--max-new-tokens T] [--temperature X --top-p P --seed S] [--json]\n"
      "lvx qa --model DIR --questions q.jsonl --output answers.jsonl [...]",
      "Answers a question about a video. Each rank decodes and encodes only its share of the\n"
      "frames; the prompt is the model family's template; the prefill runs the plan's per-layer\n"
      "strategies and generation decodes by pass-Q through each rank's KV cache (no rank holds\n"
      "all visual K/V). The answer streams to stdout (--json: one JSON object instead).\n"
      "Batch: each JSONL line {\"id\", \"video\", \"question\", \"options\": [...], \"answer\",\n"
      "\"start\", \"end\"} (options, answer, start, end optional) gets one output row, appended "
      "as\n"
      "it is answered; failed lines get a row with \"error\"; ids already answered in the\n"
      "output are skipped (a killed run continues). The settings (model, frames, range,\n"
      "generation) are kept in <output>.settings.json: a rerun with others is refused\n"
      "unless --overwrite. Errors and progress go to stderr, answers to stdout.");
  add_qa_options(p);
  if (!p.parse(argc, argv)) return 0;
  lvx::runtime::QaJob job = qa_job_of(p);
  if (lvx::cli::inside_rank()) {
    job.lead_threads = lvx::cli::host_threads(lvx::cli::apply_threads(p));
    return lvx::runtime::run_qa_rank(job);
  }
  lvx::runtime::validate_qa_job(job);  // bad input fails once, clearly, before ranks start
  const int nproc = p.get("nproc") == "auto" ? lvx::runtime::choose_ranks(job, most_ranks(job))
                                             : lvx::cli::checked_nproc(p);
  lvx::cli::apply_threads(p, nproc);
  lvx::runtime::check_local_devices(job.device, nproc);
  // the answer (or JSON) on stdout as rank 0 writes it
  return lvx::cli::launch_model_job(argc, argv, nproc, job.model, job.adapter,
                                    /*rank0_direct=*/true);
}

}  // namespace

LVX_COMMAND("qa", "answer questions about videos (one, or a JSONL batch) on N ranks", cmd_qa);
