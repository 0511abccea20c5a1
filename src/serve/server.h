// `lvx serve`: an OpenAI-compatible server of long-video question answering on N ranks.
//
// Every rank loads the model once (src/runtime/qa_job.h QaSession) and keeps its share of each
// video's encoded frames (src/runtime/visual_cache.h). Rank 0 also serves HTTP (cpp-httplib):
// it reads and checks each request (src/serve/openai_api.h), queues it (at most max_queue
// waiting: 429 beyond), and its main thread schedules them (continuous batching): while fewer
// than max_batch generations run, it takes the next request (requests identical in what their
// tokens depend on share one generation, queued or arriving while it runs), broadcasts a
// compact description (the fields and the media bytes sent inline, src/serve/wire.h) and every
// rank starts it as `lvx qa` does (per-rank frames, the plan's strategies, the prefill); then
// one step gives every running generation its next token (one decode step for all,
// Model::decode_rows; pass-Q decoding), and rank 0 streams each text to its clients as tokens
// arrive; a generation that is done leaves the batch with its row. A new request's frames are
// decoded (and, on a cache miss with a long prompt, encoded) on a worker thread of each rank, and
// its prompt is prefilled in chunks of --max-batch-tokens, one chunk between two steps (chunked
// prefill), so a long video's first question holds the others one chunk at a time. A client that goes
// away (a stream that can no longer be written; a non-streaming client's socket closed, looked at
// every 100 ms while it waits) cancels its request: not run if queued, stopped at its next token
// if running (the stop flag travels with the token).
//
// Endpoints: POST /v1/chat/completions, GET /v1/models (with --api-key: both need
// "Authorization: Bearer K", else 401), GET /health (200, or 503 once a rank failed or while
// shutting down), GET /metrics (Prometheus text: requests by status, tokens, time to first token,
// visual cache hits/misses/bytes, cancelled requests, queue depth).
//
// Faults: while idle rank 0 sends a heartbeat command (a broadcast and a barrier) every quarter
// of LVX_DIST_TIMEOUT_S (at most 5 s), so a rank that dies is found within about one timeout
// whether or not a request is running: every waiting and running request gets 503, and the
// server exits 1. SIGTERM (or SIGINT) stops taking requests (503), finishes those in flight and
// queued, tells the other ranks to stop, and exits 0; the other ranks ignore the signal and wait
// for rank 0's word.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/runtime/qa_job.h"

namespace lvx::serve {

struct ServeOptions {
  runtime::QaJob job;  // model, device, dtype, strategies, default sampling (num_frames, fps)
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (printed)
  // Any one of them is required ('Authorization: Bearer KEY'); none: no key. One per client or
  // tenant: a video's uuid is known only under the key that sent it. Compared in constant time;
  // the ranks get them by environment.
  std::vector<std::string> api_keys;
  bool metrics_public = false;  // /metrics without the key (--metrics-public)
  // One visual cache for every key (--shared-visual-cache): a key's request may then be answered
  // from another key's entry, and learn from its speed or its visual_cache figures that the same
  // media was sent before. Off: each key's entries answer that key alone.
  bool shared_visual_cache = false;
  std::string model_name;  // what requests name; default: the model folder's name
  std::string allowed_media_path;
  int64_t cache_bytes = int64_t{4} << 30;  // per rank
  int64_t max_queue = 64;
  int64_t max_body_bytes = int64_t{512} << 20;
  // Request bytes held at once over every request (src/serve/inflight_budget.h): beyond it a
  // request is refused from its headers (429; 413 when larger than the whole budget).
  int64_t max_inflight_bytes = int64_t{1} << 30;
  // Client connections open at once (src/serve/gate.h): past it a new one gets 503 (only
  // /health and /metrics are answered, for 64 more).
  int64_t max_connections = 256;
  // KV bytes per rank (visual K/V and KV cache) the running generations may hold together
  // (src/serve/kv_budget.h): a request that fits waits for room, one that never can gets 400.
  // 0: no budget (admission counts requests only).
  int64_t max_kv_bytes = 0;
  double header_timeout_s = 5;     // a request's whole header (beyond: 408)
  double body_min_rate = 1 << 20;  // bytes/s a body averages, after 10 s (below: 408)
  int64_t default_max_tokens = 256;
  // Queued requests identical in everything their tokens depend on share one generation.
  bool merge_identical = true;
  // Generations running together (continuous batching): each decode step gives every one its
  // next token in one pass through the model (Model::decode_rows); a new request's prefill runs
  // between two steps, in chunks of job.generation.prefill_chunk tokens (--max-batch-tokens).
  // 1: one generation at a time, its prompt whole: lvx qa's answer bit for bit.
  int64_t max_batch = 16;
};

// Runs this rank of the server (rendezvous from the environment) until SIGTERM (0) or a failure
// of a rank (1).
int run_serve_rank(const ServeOptions& options);

}  // namespace lvx::serve
