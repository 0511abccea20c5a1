// lvx serve's counters on rank 0 and their Prometheus text (GET /metrics; docs/serve.md lists
// them).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

namespace lvx::serve {

// A Prometheus histogram: counts per upper bound (cumulative when written), sum and count.
struct Histogram {
  std::vector<double> buckets;  // upper bounds, ascending (+Inf implied)
  std::vector<int64_t> counts = std::vector<int64_t>(buckets.size(), 0);
  double sum = 0;
  int64_t count = 0;
  void observe(double x);
  // # HELP, # TYPE, the cumulative buckets, _sum and _count of `name`.
  void write(std::ostream& os, const std::string& name, const std::string& help) const;
};

// Prometheus counters (rank 0).
struct Metrics {
  std::mutex mu;
  std::map<int, int64_t> requests;  // by HTTP status
  int64_t prompt_tokens = 0, completion_tokens = 0;
  // Latencies (seconds): a request's wait from arrival until its generation starts, its time to
  // first text, the gaps between its text pieces, and arrival to the end of its answer.
  Histogram queue{{0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60}};
  Histogram ttft{{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  Histogram inter_token{{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}};
  Histogram request{{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300}};
  int64_t cache_hits = 0, cache_misses = 0, cache_bytes = 0;  // over every rank
  int64_t prefix_reuses = 0;  // requests whose prompt prefix state was reused
  int64_t cancelled = 0;  // requests whose client went away before the answer ended
  int64_t merged = 0;     // requests answered by an identical request's generation
  // Continuous batching: decode steps, the generations they stepped, the most in one step.
  int64_t steps = 0, step_rows = 0, most_rows = 0;
  // Chunked prefill: prompt chunks run, and decode steps run while a prompt had chunks left.
  int64_t prefill_chunks = 0, steps_while_prefilling = 0;
  void count(int status);
  // Adds `seconds` to histogram `h` of these metrics, under the lock.
  void observe(Histogram Metrics::*h, double seconds);
};

// What the text reports beside the counters: read when /metrics is asked.
struct Gauges {
  int64_t cache_entries = 0, cache_capacity = 0;  // rank 0's visual cache
  int64_t queue_depth = 0, running = 0, ranks = 0;
  int64_t inflight_bytes = 0, inflight_limit = 0;  // --max-inflight-bytes, and what is held
  int64_t connections = 0, max_connections = 0;    // open client connections (src/serve/gate.h)
  int64_t kv_bytes = 0, kv_limit = 0;  // the running generations' KV per rank, --max-kv-bytes
};

// The Prometheus text exposition (version 0.0.4) of `m` and `g`.
std::string prometheus_text(Metrics& m, const Gauges& g);

}  // namespace lvx::serve
