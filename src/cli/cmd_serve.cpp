// `lvx serve`: an OpenAI-compatible long-video QA server on N ranks (src/serve/server.h).
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/dist/launcher.h"
#include "src/runtime/device.h"
#include "src/runtime/qa_job.h"
#include "src/runtime/train_checkpoint.h"
#include "src/serve/server.h"

namespace {

void add_serve_options(lvx::cli::ArgParser& p) {
  p.add_option("model", 'm', "", "checkpoint directory (config.json, weights, tokenizer.json)",
               true);
  p.add_option("host", 0, "127.0.0.1", "address to listen on (0.0.0.0: every interface)");
  p.add_option("port", 'p', "8000", "TCP port (0: any free one, printed)");
  p.add_option("api-key", 0, "",
               "require 'Authorization: Bearer KEY' (default: none). Visible to every local user\n"
               "in the process list: prefer LVX_API_KEY or --api-key-file");
  p.add_option("api-key-file", 0, "",
               "read the API keys from this file, one per line (one per client or tenant: a\n"
               "video's uuid is known only under the key that sent it)");
  p.add_flag("metrics-public", 0, "serve /metrics without the API key");
  p.add_flag("shared-visual-cache", 0,
             "one visual cache for every API key (default: each key's entries answer it alone;\n"
             "shared, a key can tell from an answer's speed that another sent the same media)");
  p.add_option("served-model-name", 0, "", "the model's name in requests (default: DIR's name)");
  p.add_option("allowed-local-media-path", 0, "",
               "file:// media URLs must be under this folder (default: refused)");
  p.add_option("cache-bytes", 0, "4294967296",
               "visual cache per rank, bytes (0: no cache); least recently used out first");
  p.add_option("max-queue", 0, "64", "requests that may wait (beyond: 429)");
  p.add_option("max-batch", 0, "16",
               "generations that run together, one decode step for all (continuous batching); "
               "1: one at a time, each answer bit for bit lvx qa's");
  p.add_option("max-batch-tokens", 0, "32",
               "a new request's prompt is prefilled in chunks of at most this many tokens, one\n"
               "chunk between two decode steps (chunked prefill; 0: whole; with --max-batch 1\n"
               "always whole); lvx qa --max-batch-tokens N gives the same answers bit for bit");
  lvx::cli::add_chunk_keys_option(p);
  p.add_option("max-body-bytes", 0, "536870912", "largest request body (beyond: 413)");
  p.add_option("max-inflight-bytes", 0, "1073741824",
               "request bytes held at once over every request, from each one's headers until its\n"
               "answer is sent (beyond: 429, or 413 for a body larger than all of it)");
  p.add_option("max-kv-bytes", 0, "0",
               "KV bytes per rank (visual K/V and KV cache, the planner's figure for each request's\n"
               "frames, prompt and max_tokens) the running generations may hold together: a\n"
               "request waits for room, or gets 400 when it alone is larger; 0: no budget");
  p.add_option("max-connections", 0, "256",
               "client connections open at once (beyond: 503, and only /health and /metrics are\n"
               "answered, for 64 more)");
  p.add_option("header-timeout", 0, "5",
               "seconds a request's whole header may take to arrive (beyond: 408)");
  p.add_option("body-min-rate", 0, "1048576",
               "bytes/s a request body must average after its first 10 s (below: 408)");
  p.add_option("max-new-tokens", 't', "256", "tokens to generate when a request names none");
  p.add_flag("no-merge-identical", 0,
             "answer queued requests that are identical (media, question, sampling, max_tokens)\n"
             "one by one instead of with one shared generation (benchmarks)");
  p.add_option("fps", 0, "", "default sampling: frames per second");
  p.add_option("num-frames", 'f', "", "default sampling: N frames over the range (default 16)");
  p.add_option("max-frames", 0, "4096",
               "frames one request may have, whichever way it asks (num_frames, fps over its\n"
               "range, image_url parts): more is answered 400 before a frame is decoded");
  lvx::cli::add_nproc_options(p, "1", "local ranks to start");
  lvx::cli::add_threads_option(p);
  p.add_option("step-overlap", 0, "auto",
               "auto | on | off: a batched step runs each layer's independent attention calls on\n"
               "two host threads (the visual keys' beside the prompt's and the rows' own keys';\n"
               "auto: on with 4 cores or more per local rank, so that the second thread does\n"
               "not take the HTTP threads' core)");
  p.add_option("strategies", 's', "auto", "auto | S | S_cross,S_self (prefill)");
  p.add_option("cluster", 'c', "", "cluster config for --strategies auto (lvx calibrate)");
  p.add_option("dtype", 0, "auto", "fp32 | bf16 | auto (the checkpoint's where the device computes it natively: bf16 on a GPU and on CPUs with AMX or AVX512-BF16, else fp32)");
  lvx::cli::add_device_option(p);
}

// The API keys: --api-key or its mirror LVX_API_KEY (how the launcher hands them to the ranks,
// never in their argv), or --api-key-file; one key per line (a key cannot hold a line break: it
// travels in a header). Empty lines are skipped.
std::vector<std::string> api_keys(const lvx::cli::ArgParser& p) {
  LVX_CHECK(p.get("api-key").empty() || p.get("api-key-file").empty(),
            "give --api-key or --api-key-file, not both");
  const std::string text = p.get("api-key-file").empty()
                               ? p.get("api-key")
                               : lvx::read_file(p.get("api-key-file"), "--api-key-file", 1 << 20);
  std::vector<std::string> keys;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) keys.push_back(line);
  }
  LVX_CHECK(!keys.empty() || p.get("api-key-file").empty(), "--api-key-file '",
            p.get("api-key-file"), "' holds no key (every line is empty)");
  return keys;
}

std::string joined_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += (out.empty() ? "" : "\n") + l;
  return out;
}

lvx::serve::ServeOptions serve_options(const lvx::cli::ArgParser& p) {
  lvx::serve::ServeOptions o;
  lvx::runtime::QaJob& job = o.job;
  job.model = lvx::runtime::follow_run_folder(p.get("model"));
  if (!p.get("fps").empty()) job.fps = p.get_double("fps");
  if (!p.get("num-frames").empty()) job.num_frames = p.get_int("num-frames");
  job.max_frames = p.get_int("max-frames", 1, 1 << 20);
  job.generation.max_new_tokens = p.get_int("max-new-tokens", 1, INT32_MAX);
  job.plan.strategies = p.get("strategies");
  job.plan.cluster = p.get("cluster");
  job.plan.dtype = p.get("dtype");
  job.device = p.get("device");
  o.host = p.get("host");
  o.port = static_cast<int>(p.get_int("port", 0, 65535));
  o.api_keys = api_keys(p);
  o.metrics_public = p.flag("metrics-public");
  o.shared_visual_cache = p.flag("shared-visual-cache");
  o.model_name = p.get("served-model-name");
  if (o.model_name.empty()) {
    std::filesystem::path dir(job.model);
    if (!dir.has_filename()) dir = dir.parent_path();
    o.model_name = dir.filename().string();
  }
  o.allowed_media_path = p.get("allowed-local-media-path");
  o.cache_bytes = p.get_int("cache-bytes", 0, INT64_MAX);
  o.max_queue = p.get_int("max-queue", 0, 1 << 20);
  o.max_body_bytes = p.get_int("max-body-bytes", 1, INT64_MAX);
  o.max_inflight_bytes = p.get_int("max-inflight-bytes", 1, INT64_MAX);
  o.max_connections = p.get_int("max-connections", 1, 1 << 20);
  o.max_kv_bytes = p.get_int("max-kv-bytes", 0, INT64_MAX);
  o.header_timeout_s = p.get_double("header-timeout");
  o.body_min_rate = p.get_double("body-min-rate");
  LVX_CHECK(o.header_timeout_s > 0, "--header-timeout must be > 0 seconds, got ",
            o.header_timeout_s);
  LVX_CHECK(o.body_min_rate > 0, "--body-min-rate must be > 0 bytes/s, got ", o.body_min_rate);
  o.default_max_tokens = job.generation.max_new_tokens;
  o.merge_identical = !p.flag("no-merge-identical");
  o.max_batch = p.get_int("max-batch", 1, 4096);
  // One generation at a time has nothing to step between chunks: its prompt runs whole.
  job.generation.prefill_chunk = o.max_batch > 1 ? p.get_int("max-batch-tokens", 0, INT32_MAX) : 0;
  job.generation.prefill_chunk_keys = lvx::cli::chunk_keys(p);
  return o;
}

// --step-overlap: whether a rank overlaps a batched step's attention calls (QaJob::side_by_side).
// auto counts this machine's ranks as apply_threads does (lvx::cli::local_rank_count).
bool step_overlap(const lvx::cli::ArgParser& p, int local_ranks) {
  const std::string v = p.get("step-overlap");
  LVX_CHECK(v == "auto" || v == "on" || v == "off", "--step-overlap: auto, on or off, got '", v,
            "'");
  if (v != "auto") return v == "on";
  // On 2 cores (the serving thread, the HTTP threads and a benchmark's clients) it measured
  // neutral overall: faster steps with joining questions, slower plain ones (docs/serve.md).
  return lvx::cli::available_cores() >= 4 * lvx::cli::local_rank_count(local_ranks);
}

bool loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

int cmd_serve(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx serve --model DIR [--nproc N] [--host 127.0.0.1] [--port 8000] [--api-key-file F]\n"
      "          [--cache-bytes B] [--allowed-local-media-path DIR] [--max-queue Q] [--max-batch "
      "N]",
      "Serves questions about videos with the OpenAI chat-completions API (POST\n"
      "/v1/chat/completions, GET /v1/models, /health, /metrics). Every rank holds the model and\n"
      "its share of each request's frames, as lvx qa runs one question; each rank keeps its\n"
      "share of each video's encoded frames (--cache-bytes per rank), so a repeated question\n"
      "about a video decodes and encodes nothing. Up to --max-batch generations run together\n"
      "(one decode step for all; a new request's prefill runs between two steps); up to\n"
      "--max-queue more wait (429 beyond). SIGTERM finishes the requests in flight and exits\n"
      "0; a rank that dies makes the server answer 503 and exit non-zero.\n"
      "Request extensions: num_frames | fps, start, end (seconds), video_id (a name for the\n"
      "logs); vLLM's per-part uuid names a video sent before under the same API key.\n"
      "The API keys may also come from LVX_API_KEY (one per line).");
  add_serve_options(p);
  if (!p.parse(argc, argv)) return 0;
  lvx::serve::ServeOptions o = serve_options(p);
  if (lvx::cli::inside_rank()) {
    lvx::cli::apply_threads(p);
    o.job.side_by_side = step_overlap(p, 1);
    lvx::runtime::validate_qa_settings(o.job);
    return lvx::serve::run_serve_rank(o);
  }
  const int nproc = lvx::cli::checked_nproc(p);
  lvx::cli::apply_threads(p, nproc);
  o.job.side_by_side = step_overlap(p, nproc);  // bad values fail once, before ranks start
  lvx::runtime::validate_qa_settings(o.job);    // bad flags fail once, before ranks start
  LVX_CHECK(o.allowed_media_path.empty() || std::filesystem::is_directory(o.allowed_media_path),
            "--allowed-local-media-path '", o.allowed_media_path, "' is not a folder");
  lvx::runtime::check_local_devices(o.job.device, nproc);
  if (!p.get("api-key").empty())
    std::cerr << "lvx serve: warning: --api-key is visible to every local user in the process "
                 "list; use LVX_API_KEY or --api-key-file\n";
  if (o.api_keys.empty() && !loopback(o.host))
    std::cerr << "lvx serve: warning: listening on " << o.host
              << " beyond the loopback without an API key: anyone who reaches it can use it "
                 "(--api-key-file, LVX_API_KEY)\n";
  lvx::dist::LaunchOptions lo;
  lo.nproc = nproc;
  lo.rank0_direct = true;
  // Rank 0 answers the clients when another rank dies (503), then exits non-zero itself; a
  // SIGTERM to this launcher goes to every rank (rank 0 drains, then tells the others).
  lo.stop_on_failure = false;
  lo.exit_wait_s = lvx::dist::default_exit_wait_s();
  lo.forward_signals = true;
  std::vector<std::string> cmd{lvx::dist::self_executable()};
  for (int i = 0; i < argc; ++i) cmd.push_back(argv[i]);
  lvx::cli::pin_option_for_ranks(cmd, "model", 'm', o.job.model);
  lvx::cli::pin_option_for_ranks(cmd, "api-key", 0,
                                 joined_lines(o.api_keys));  // never in a rank's argv
  lvx::cli::pin_option_for_ranks(cmd, "api-key-file", 0, "");
  return lvx::dist::launch_local(cmd, lo).exit_code;
}

}  // namespace

LVX_COMMAND("serve", "serve questions about videos over the OpenAI chat API on N ranks", cmd_serve);
