// lvx serve's counters; see metrics.h.
#include "src/serve/metrics.h"

#include <sstream>

namespace lvx::serve {

void Metrics::count(int status) {
  std::lock_guard<std::mutex> lock(mu);
  ++requests[status];
}

void Histogram::observe(double x) {
  sum += x;
  ++count;
  for (size_t i = 0; i < buckets.size(); ++i)
    if (x <= buckets[i]) {
      ++counts[i];
      break;
    }
}

void Histogram::write(std::ostream& os, const std::string& name, const std::string& help) const {
  os << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
  int64_t cum = 0;
  for (size_t i = 0; i < buckets.size(); ++i) {
    cum += counts[i];
    os << name << "_bucket{le=\"" << buckets[i] << "\"} " << cum << "\n";
  }
  os << name << "_bucket{le=\"+Inf\"} " << count << "\n"
     << name << "_sum " << sum << "\n"
     << name << "_count " << count << "\n";
}

void Metrics::observe(Histogram Metrics::*h, double seconds) {
  std::lock_guard<std::mutex> lock(mu);
  (this->*h).observe(seconds);
}

std::string prometheus_text(Metrics& mx, const Gauges& g) {
  std::ostringstream m;
  std::lock_guard<std::mutex> lock(mx.mu);
  m << "# HELP lvx_requests_total Chat completion requests answered, by HTTP status.\n"
    << "# TYPE lvx_requests_total counter\n";
  for (const auto& [status, n] : mx.requests)
    m << "lvx_requests_total{status=\"" << status << "\"} " << n << "\n";
  m << "# TYPE lvx_prompt_tokens_total counter\nlvx_prompt_tokens_total " << mx.prompt_tokens
    << "\n"
    << "# TYPE lvx_generated_tokens_total counter\nlvx_generated_tokens_total "
    << mx.completion_tokens << "\n";
  mx.queue.write(m, "lvx_queue_seconds",
                 "From a request's arrival until its generation starts (admitted to the batch).");
  mx.ttft.write(m, "lvx_time_to_first_token_seconds",
                "From a request's arrival to its first text.");
  mx.inter_token.write(m, "lvx_inter_token_seconds",
                       "Between two text pieces of one answer (a piece is each token's text).");
  mx.request.write(m, "lvx_request_seconds", "From a request's arrival to the end of its answer.");
  m << "# HELP lvx_visual_cache_hits_total Ranks that found their share of a request's frames "
       "encoded already (summed over ranks).\n"
    << "# TYPE lvx_visual_cache_hits_total counter\nlvx_visual_cache_hits_total " << mx.cache_hits
    << "\n"
    << "# TYPE lvx_visual_cache_misses_total counter\nlvx_visual_cache_misses_total "
    << mx.cache_misses << "\n"
    << "# HELP lvx_prefix_reuses_total Requests whose prompt prefix (up to its last image token) "
       "started from the state a previous request's prefill left (every rank's, kept with the "
       "video's visual features).\n"
    << "# TYPE lvx_prefix_reuses_total counter\nlvx_prefix_reuses_total " << mx.prefix_reuses
    << "\n"
    << "# HELP lvx_visual_cache_bytes Bytes held by the visual caches of every rank.\n"
    << "# TYPE lvx_visual_cache_bytes gauge\nlvx_visual_cache_bytes " << mx.cache_bytes << "\n"
    << "# TYPE lvx_visual_cache_entries gauge\nlvx_visual_cache_entries{rank=\"0\"} "
    << g.cache_entries << "\n"
    << "# TYPE lvx_visual_cache_capacity_bytes gauge\nlvx_visual_cache_capacity_bytes{rank=\"0\"} "
    << g.cache_capacity << "\n"
    << "# HELP lvx_requests_cancelled_total Requests whose client went away before the answer "
       "ended (their generation stopped, or never ran).\n"
    << "# TYPE lvx_requests_cancelled_total counter\nlvx_requests_cancelled_total " << mx.cancelled
    << "\n"
    << "# HELP lvx_requests_merged_total Requests answered by the generation of an identical "
       "request (queued with them, or running when they arrived).\n"
    << "# TYPE lvx_requests_merged_total counter\nlvx_requests_merged_total " << mx.merged << "\n"
    << "# HELP lvx_decode_steps_total Decode steps run (each gives every running generation its "
       "next token).\n"
    << "# TYPE lvx_decode_steps_total counter\nlvx_decode_steps_total " << mx.steps << "\n"
    << "# HELP lvx_decode_step_rows_total Generations stepped, summed over the decode steps (over "
       "lvx_decode_steps_total: the mean batch).\n"
    << "# TYPE lvx_decode_step_rows_total counter\nlvx_decode_step_rows_total " << mx.step_rows
    << "\n"
    << "# TYPE lvx_decode_batch_max gauge\nlvx_decode_batch_max " << mx.most_rows << "\n"
    << "# HELP lvx_prefill_chunks_total Prompt chunks run (chunked prefill, --max-batch-tokens "
       "tokens each, one between two decode steps).\n"
    << "# TYPE lvx_prefill_chunks_total counter\nlvx_prefill_chunks_total " << mx.prefill_chunks
    << "\n"
    << "# HELP lvx_decode_steps_during_prefill_total Decode steps run while a prompt still had "
       "chunks to prefill (the rows it did not hold up).\n"
    << "# TYPE lvx_decode_steps_during_prefill_total counter\n"
       "lvx_decode_steps_during_prefill_total "
    << mx.steps_while_prefilling << "\n"
    << "# TYPE lvx_queue_depth gauge\nlvx_queue_depth " << g.queue_depth << "\n"
    << "# TYPE lvx_requests_running gauge\nlvx_requests_running " << g.running << "\n"
    << "# TYPE lvx_ranks gauge\nlvx_ranks " << g.ranks << "\n"
    << "# HELP lvx_inflight_bytes Request bytes held now (declared bodies, from their headers "
       "until their answers are sent).\n"
    << "# TYPE lvx_inflight_bytes gauge\nlvx_inflight_bytes " << g.inflight_bytes << "\n"
    << "# TYPE lvx_inflight_limit_bytes gauge\nlvx_inflight_limit_bytes " << g.inflight_limit
    << "\n"
    << "# HELP lvx_connections Open client connections (--max-connections; past it, new ones get "
       "503)\n"
    << "# TYPE lvx_connections gauge\nlvx_connections " << g.connections << "\n"
    << "# TYPE lvx_max_connections gauge\nlvx_max_connections " << g.max_connections << "\n"
    << "# HELP lvx_kv_bytes KV bytes per rank the running generations hold, as admission prices "
       "them (--max-kv-bytes; 0 there: no budget).\n"
    << "# TYPE lvx_kv_bytes gauge\nlvx_kv_bytes " << g.kv_bytes << "\n"
    << "# TYPE lvx_kv_limit_bytes gauge\nlvx_kv_limit_bytes " << g.kv_limit << "\n";
  return m.str();
}

}  // namespace lvx::serve
