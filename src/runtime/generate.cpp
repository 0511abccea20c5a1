#include "src/runtime/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include "models/lead_decode.h"
#include "src/common/error.h"

namespace lvx::runtime {

void check_sampling(const SamplingOptions& s) {
  LVX_CHECK(std::isfinite(s.temperature) && s.temperature >= 0,
            "--temperature must be a finite number >= 0 (0: greedy), got ", s.temperature);
  LVX_CHECK(std::isfinite(s.top_p) && s.top_p > 0 && s.top_p <= 1,
            "--top-p must be in (0, 1], got ", s.top_p);
}

at::Tensor pick_tokens(const at::Tensor& logits, const SamplingOptions& s, at::Generator& gen) {
  check_sampling(s);
  // Tokens are host values (they steer the loop and are broadcast from rank 0): greedy picks on
  // the logits' device and copies B ids back; sampling draws on the host with the seeded CPU
  // generator, so a seed gives the same tokens on every device.
  if (s.temperature <= 0) return logits.argmax(-1).cpu();
  // Shifted by the largest logit first, so that a tiny temperature cannot overflow to inf/nan.
  const at::Tensor x = logits.to(at::kCPU, at::kDouble);
  const at::Tensor probs =
      at::softmax((x - std::get<0>(x.max(-1, /*keepdim=*/true))) / s.temperature, -1);
  auto [sorted, order] = probs.sort(-1, /*descending=*/true);
  // Keep a token while the probability before it is below top_p (the first always stays).
  const at::Tensor before = sorted.cumsum(-1) - sorted;
  const at::Tensor kept = sorted.masked_fill(before >= s.top_p, 0.0);
  const at::Tensor choice = at::multinomial(kept, 1, /*replacement=*/false, gen);  // [B, 1]
  return order.gather(-1, choice).squeeze(-1);
}

int64_t prompt_prefix(const at::Tensor& ids, int64_t media_token) {
  const at::Tensor host = ids.to(at::kCPU).to(at::kLong).contiguous();
  const int64_t B = host.size(0), L = host.size(1);
  const int64_t* p = host.data_ptr<int64_t>();
  int64_t last = -1;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = L - 1; t > last; --t)
      if (p[b * L + t] == media_token) {
        last = t;
        break;
      }
  return last < 0 || last + 1 >= L ? 0 : last + 1;
}

Generation::Generation(const models::Model& model, const models::ModelInputs& in,
                       const models::Parallel& par, const GenerateOptions& o)
    : o_(o) {
  LVX_CHECK(o.max_new_tokens >= 1, "--max-new-tokens must be >= 1, got ", o.max_new_tokens);
  check_sampling(o.sampling);
  LVX_CHECK(o.logprobs < 0 || in.input_ids.size(0) == 1,
            "log-probabilities are given for one sample at a time, got a batch of ",
            in.input_ids.size(0));
  const int64_t prompt = in.input_ids.size(1);
  max_new_ = o.max_new_tokens;
  if (o.max_length > 0) {
    LVX_CHECK(prompt < o.max_length, "the prompt has ", prompt,
              " tokens, more than the model's context of ", o.max_length,
              " tokens leaves room for (at least one new token)");
    max_new_ = std::min(max_new_, o.max_length - prompt);
  }
  dist::ProcessGroup& pg = *par.pg;
  using clock = std::chrono::steady_clock;
  gen_ = at::make_generator<at::CPUGeneratorImpl>(o.sampling.seed);
  batch_ = in.input_ids.size(0);
  stop_ = at::tensor(o.stop.empty() ? std::vector<int64_t>{-1} : o.stop, at::kLong);
  done_ = at::zeros({batch_}, at::kBool);
  last_stop_ = at::zeros({batch_}, at::kLong);
  const int64_t sent0 = pg.counters().total_sent();
  const auto t0 = clock::now();
  // Processor inputs along the sequence (OpenFlamingo's attention_mask, Mllama's
  // cross_attention_mask) would have to be cut too: such a batch runs whole.
  const int64_t split = in.named.empty() && model.can_extend()
                            ? prompt_prefix(in.input_ids, model.media_token_id())
                            : 0;
  if (split == 0) {
    logits_ = model.prefill(in, par, cache_);
  } else {
    // The prefix as a prefill (or its state reused, or its chunks to come), then the rest.
    const models::DecodeCache* reused = o.cached_prefix ? o.cached_prefix() : nullptr;
    const at::Tensor host = in.input_ids.to(at::kCPU).to(at::kLong);
    const at::Tensor tail = host.narrow(1, split, prompt - split);
    r_.prefix_tokens = split;
    if (reused != nullptr) {
      cache_ = *reused;  // the tensors are shared and never written; the lists are copied
      cache_.encode_seconds = 0;
      r_.prefix_reused = true;
      start_tail(model, par, tail);
    } else if (prefills_in_chunks(model, o, split)) {
      models::ModelInputs head = in;
      head.input_ids = in.input_ids.narrow(1, 0, split);
      if (o.prefilled_media)
        cache_ = *o.prefilled_media;
      else
        model.prefill_media(head, par, cache_);
      pending_ = host.narrow(1, 0, split).contiguous();
      pending_tail_ = tail;
    } else {
      models::ModelInputs head = in;
      head.input_ids = in.input_ids.narrow(1, 0, split);
      model.prefill(head, par, cache_);
      if (o.store_prefix) o.store_prefix(cache_);
      start_tail(model, par, tail);
    }
  }
  r_.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  r_.prefill_bytes_sent = pg.counters().total_sent() - sent0;
  r_.encode_seconds = cache_.encode_seconds;
}

int64_t chunk_length(const at::Tensor& reads, int64_t at, int64_t split, int64_t tokens,
                     int64_t key_budget) {
  const int64_t most = std::min(tokens, split - at);
  if (key_budget <= 0 || most <= 1) return most;
  LVX_CHECK(reads.defined() && reads.dim() == 1 && reads.size(0) >= split &&
                reads.scalar_type() == at::kLong,
            "chunked prefill: the prompt's key reads must be int64 [", split, "]");
  const int64_t* r = reads.data_ptr<int64_t>() + at;
  int64_t n = 1, sum = r[0];
  while (n < most && sum + r[n] <= key_budget) sum += r[n++];
  return n;
}

bool prefills_in_chunks(const models::Model& model, const GenerateOptions& o, int64_t split) {
  return o.prefill_chunk > 0 && split > o.prefill_chunk && model.can_prefill_in_chunks();
}

void Generation::start_tail(const models::Model& model, const models::Parallel& par,
                            const at::Tensor& tail) {
  if (o_.defer_tail && batch_ == 1)
    tail_ = tail.contiguous();
  else
    logits_ = model.extend(tail, par, cache_);
}

void Generation::prefill_next(const models::Model& model, const models::Parallel& par) {
  LVX_CHECK(prefilling(), "prefill_next: no prompt is being prefilled in chunks");
  dist::ProcessGroup& pg = *par.pg;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t sent0 = pg.counters().total_sent();
  const int64_t split = pending_.size(1);
  const int64_t n = chunk_length(cache_.prompt_key_reads, pending_at_, split, o_.prefill_chunk,
                                 o_.prefill_chunk_keys);
  logits_ = model.extend(pending_.narrow(1, pending_at_, n), par, cache_);
  pending_at_ += n;
  ++r_.prefill_chunks;
  if (pending_at_ == split) {
    models::seal_chunked_prompt(cache_, pg.rank(), pg.world_size());
    pending_ = at::Tensor();
    if (o_.store_prefix) o_.store_prefix(cache_);
    start_tail(model, par, pending_tail_);
    pending_tail_ = at::Tensor();
  }
  r_.prefill_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r_.prefill_bytes_sent += pg.counters().total_sent() - sent0;
}

at::Tensor Generation::pick() {
  // A rank that did not decode (lead decoding's others): a stand-in, replaced by rank 0's pick.
  if (!logits_.defined()) return at::zeros({batch_}, at::kLong);
  if (o_.keep_logits) logits_kept_.push_back(logits_);
  return pick_tokens(logits_, o_.sampling, gen_).to(at::kLong).contiguous();
}

bool Generation::take(at::Tensor next, bool stop_now,
                      const std::function<void(const at::Tensor&)>& on_token) {
  if (stop_now) {
    r_.stopped = true;
    finished_ = true;
    return false;
  }
  bool all_done = false;
  if (batch_ == 1) {  // one sample (lvx serve's rows): the stop check on the host, no tensor ops
    const int64_t id = next.data_ptr<int64_t>()[0];
    all_done = std::find(o_.stop.begin(), o_.stop.end(), id) != o_.stop.end();
  } else {  // a sample that stopped repeats its stop token while the others go on
    next = at::where(done_, last_stop_, next);
    const at::Tensor is_stop = at::isin(next, stop_);
    last_stop_ = at::where(is_stop & done_.logical_not(), next, last_stop_);
    done_ = done_ | is_stop;
    all_done = done_.all().item<bool>();
  }
  if (o_.logprobs >= 0 && logits_.defined())
    r_.logprobs.push_back(token_logprobs(logits_[0], next[0].item<int64_t>(), o_.logprobs));
  tokens_.push_back(next);
  if (on_token) on_token(next);
  ++step_;
  if (all_done) {
    finished_ = true;
  } else if (step_ == max_new_) {
    r_.hit_context = max_new_ < o_.max_new_tokens;
    finished_ = true;
  }
  return !finished_;
}

GenerateResult Generation::finish() {
  GenerateResult r = r_;
  r.tokens = tokens_.empty() ? at::zeros({batch_, 0}, at::kLong) : at::stack(tokens_, 1);
  // Under lead decoding the other ranks keep only the prefill's logits (rank 0 has every step's).
  if (o_.keep_logits && !logits_kept_.empty()) r.step_logits = at::stack(logits_kept_, 1);
  return r;
}

// step_together's two parts, friends of Generation.
struct RowsStep {
  // Rank 0's tokens of the rows that have logits, and each one's stop flag, in one broadcast:
  // [row 0's B tokens, flag, ...]; each row takes its token. The rows that go on, with their
  // tokens (they need a decode step).
  static std::vector<std::pair<Generation*, at::Tensor>> pick(
      const std::vector<Generation*>& rows, dist::ProcessGroup& pg,
      const std::vector<std::function<void(const at::Tensor&)>>& on_token);
  // The tokens of rows[picking[p]] (each row's pick; the greedy one-sample rows' in one argmax).
  static std::vector<at::Tensor> pick_all(const std::vector<Generation*>& rows,
                                          const std::vector<size_t>& picking);
  // One forward of every row's tokens (pairs: a decode step's token, or a joining row's prompt
  // tail); each row's logits kept for its next pick.
  static void forward(const std::vector<std::pair<Generation*, at::Tensor>>& rows, size_t joining,
                      const models::Model& model, const models::Parallel& par);
  // Lead decoding's start (models/lead_decode.h): the prompt's keys gathered to rank 0 once,
  // counted as the prompt's time and bytes (not the steps').
  static void gather_for_lead(Generation& g, dist::ProcessGroup& pg);
  // The prompt tails waiting for this step (defer_tail), appended to `forward`; how many.
  static size_t add_tails(const std::vector<Generation*>& rows,
                          std::vector<std::pair<Generation*, at::Tensor>>& forward);
};

size_t RowsStep::add_tails(const std::vector<Generation*>& rows,
                           std::vector<std::pair<Generation*, at::Tensor>>& forward) {
  size_t n = 0;
  for (Generation* g : rows)
    if (g->tail_.defined()) {
      forward.emplace_back(g, g->tail_);
      ++n;
    }
  return n;
}

std::vector<at::Tensor> RowsStep::pick_all(const std::vector<Generation*>& rows,
                                           const std::vector<size_t>& picking) {
  std::vector<at::Tensor> picked(picking.size());
  if (picking.size() == 1) {  // a lone row: its own pick, as generate() takes it
    picked[0] = rows[picking[0]]->pick();
    return picked;
  }
  std::vector<size_t> greedy;  // one-sample greedy rows: one argmax over their logits' rows
  for (size_t p = 0; p < picking.size(); ++p) {
    Generation& g = *rows[picking[p]];
    if (g.batch_ == 1 && g.o_.sampling.temperature <= 0 && !g.o_.keep_logits)
      greedy.push_back(p);
    else
      picked[p] = g.pick();
  }
  if (greedy.empty()) return picked;
  std::vector<at::Tensor> logits;
  for (size_t p : greedy) logits.push_back(rows[picking[p]]->logits_);
  // Row by row the argmax each row's own pick_tokens takes (the lowest id on ties).
  const at::Tensor ids = at::cat(logits, 0).argmax(-1).to(at::kCPU, at::kLong).contiguous();
  for (size_t j = 0; j < greedy.size(); ++j)
    picked[greedy[j]] = ids.narrow(0, static_cast<int64_t>(j), 1);
  return picked;
}

std::vector<std::pair<Generation*, at::Tensor>> RowsStep::pick(
    const std::vector<Generation*>& rows, dist::ProcessGroup& pg,
    const std::vector<std::function<void(const at::Tensor&)>>& on_token) {
  std::vector<size_t> picking;
  bool any_stop_hook = false;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i]->tail_.defined()) continue;  // its logits come from this step's forward
    picking.push_back(i);
    any_stop_hook = any_stop_hook || static_cast<bool>(rows[i]->o_.stop_requested);
  }
  if (picking.empty()) return {};
  const std::vector<at::Tensor> picked = pick_all(rows, picking);
  // The message is built and read on the host (a few values per row, no tensor op per row).
  std::vector<int64_t> values;
  for (size_t p = 0; p < picking.size(); ++p) {
    const int64_t* ids = picked[p].data_ptr<int64_t>();
    values.insert(values.end(), ids, ids + picked[p].numel());
    if (!any_stop_hook) continue;
    const auto& ask = rows[picking[p]]->o_.stop_requested;
    values.push_back(pg.rank() == 0 && ask && ask() ? 1 : 0);
  }
  at::Tensor msg = at::tensor(values, at::kLong);
  pg.broadcast(msg, 0);  // rank 0's choice (sampling draws on rank 0 only matter)
  const int64_t* got = msg.data_ptr<int64_t>();
  std::vector<std::pair<Generation*, at::Tensor>> go_on;
  for (size_t p = 0, at = 0; p < picking.size(); ++p) {
    const size_t i = picking[p];
    Generation& g = *rows[i];
    const int64_t b = g.batch_;
    const at::Tensor tok = msg.narrow(0, static_cast<int64_t>(at), b);
    const bool stop_now = any_stop_hook && got[static_cast<int64_t>(at) + b] != 0;
    at += static_cast<size_t>(b + (any_stop_hook ? 1 : 0));
    if (g.take(tok, stop_now, i < on_token.size() ? on_token[i] : nullptr))
      go_on.emplace_back(&g, g.tokens_.back());
  }
  return go_on;
}

void RowsStep::forward(const std::vector<std::pair<Generation*, at::Tensor>>& rows, size_t joining,
                       const models::Model& model, const models::Parallel& par) {
  dist::ProcessGroup& pg = *par.pg;
  if (rows.size() == 1 && joining == 0 && models::leads_decode(par))
    gather_for_lead(*rows[0].first, pg);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t sent0 = pg.counters().total_sent();
  at::Tensor logits;
  if (rows.size() == 1 && joining == 0 && models::leads_decode(par)) {
    // One generation stepped alone: rank 0 decodes, the others answer at the cross layers
    // (models/lead_decode.h); their logits stay undefined (rank 0's pick is broadcast).
    logits = models::lead_decode_step(model, rows[0].second, par, rows[0].first->cache_);
  } else if (rows.size() == 1 && joining == 0) {  // one generation of any batch, every rank
    logits = model.decode_step(rows[0].second, par, rows[0].first->cache_);
  } else if (rows.size() == 1) {
    logits = model.extend(rows[0].second, par, rows[0].first->cache_);
  }
  std::vector<size_t> at(rows.size(), 0);  // row i's logits: logits[at[i]]
  if (rows.size() > 1) {
    // The rows about one video side by side (models::rows_by_keys): their cached keys are then
    // read as runs, with no gather per layer.
    std::vector<const models::DecodeCache*> keyed;
    for (const auto& row : rows) keyed.push_back(&row.first->cache_);
    const std::vector<size_t> order = models::rows_by_keys(keyed);
    std::vector<at::Tensor> tokens;
    std::vector<models::DecodeCache*> caches;
    for (size_t j = 0; j < order.size(); ++j) {
      const auto& [g, t] = rows[order[j]];
      LVX_CHECK(g->batch_ == 1, "step_together: generations of one sample each, got ", g->batch_);
      tokens.push_back(t.view({-1}));
      caches.push_back(&g->cache_);
      at[order[j]] = j;
    }
    logits = model.extend_rows(tokens, par, caches);
  }
  // Each row's step costs the whole forward's time and bytes (what its client waited for); a
  // joining row's prompt time includes its tail's.
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t bytes = pg.counters().total_sent() - sent0;
  for (size_t i = 0; i < rows.size(); ++i) {
    Generation& g = *rows[i].first;
    g.logits_ = logits.defined()
                    ? logits.narrow(0, static_cast<int64_t>(at[i]) * g.batch_, g.batch_)
                    : logits;
    if (i + joining < rows.size()) {
      g.r_.token_seconds.push_back(secs);
      g.r_.decode_bytes_sent += bytes;
    } else {
      g.tail_ = at::Tensor();
      g.r_.prefill_seconds += secs;
      g.r_.prefill_bytes_sent += bytes;
    }
  }
}

void RowsStep::gather_for_lead(Generation& g, dist::ProcessGroup& pg) {
  if (g.cache_.prompt_whole) return;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t sent0 = pg.counters().total_sent();
  models::gather_prompt_to_lead(pg, g.cache_);
  g.r_.prefill_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  g.r_.prefill_bytes_sent += pg.counters().total_sent() - sent0;
}

void step_together(const std::vector<Generation*>& rows, const models::Model& model,
                   const models::Parallel& par,
                   const std::vector<std::function<void(const at::Tensor&)>>& on_token) {
  for (const Generation* g : rows)
    LVX_CHECK(!g->done() && !g->prefilling(),
              "step_together: a generation that is done or still prefilling");
  std::vector<std::pair<Generation*, at::Tensor>> forward = RowsStep::pick(rows, *par.pg, on_token);
  // Rows whose prompt tail waited for this step (defer_tail) run it in the same forward as the
  // others' next tokens, after them.
  const size_t joining = RowsStep::add_tails(rows, forward);
  if (!forward.empty()) RowsStep::forward(forward, joining, model, par);
}

TokenLogprobs token_logprobs(const at::Tensor& logits, int64_t token, int64_t top) {
  const at::Tensor lp = at::log_softmax(logits.to(at::kCPU, at::kFloat), -1);
  TokenLogprobs t;
  t.token = token;
  t.logprob = lp[token].item<double>();
  if (top <= 0) return t;
  const auto [values, ids] = at::topk(lp, std::min<int64_t>(top, lp.size(0)));
  for (int64_t i = 0; i < values.size(0); ++i)
    t.top.emplace_back(ids[i].item<int64_t>(), values[i].item<double>());
  // Most likely first; equal log-probabilities by id (topk leaves their order open).
  std::sort(t.top.begin(), t.top.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  return t;
}

namespace {

// Sample b of a batch as inputs of its own (generate_rows).
models::ModelInputs sample_inputs(const models::Model& model, const models::ModelInputs& in,
                                  int64_t b) {
  const int64_t B = in.input_ids.size(0);
  models::ModelInputs one{in.input_ids.narrow(0, b, 1), at::Tensor(), in.pixels_local, {}};
  for (const auto& [name, t] : in.named)
    one.named[name] = t.dim() > 0 && t.size(0) == B ? t.narrow(0, b, 1) : t;
  const at::Tensor& px = in.pixel_values;
  if (!px.defined()) return one;
  if (px.dim() >= 5 && px.size(0) == B) {
    one.pixel_values = px.narrow(0, b, 1);
  } else {  // flat, in prompt order: the images of the rows before b come first
    const at::Tensor media = in.input_ids.to(at::kCPU).eq(model.media_token_id()).sum(1);
    const int64_t before = b == 0 ? 0 : media.narrow(0, 0, b).sum().item<int64_t>();
    one.pixel_values = px.narrow(0, before, media[b].item<int64_t>());
  }
  return one;
}

}  // namespace

GenerateResult generate_rows(const models::Model& model, const models::ModelInputs& in,
                             const models::Parallel& rows_par, const GenerateOptions& o) {
  LVX_CHECK(!in.pixels_local, "generate_rows: the batch's whole pixel_values are needed");
  // As lvx serve admits them: each prompt's tail (after its kept prefix) waits for the first
  // step, which extends every row's at once (Model::extend_rows).
  GenerateOptions each = o;
  each.defer_tail = true;
  // Rows that step together keep their caches sharded alike: no lead decoding, even for a row
  // left alone.
  models::Parallel par = rows_par;
  par.lead_decode = false;
  std::vector<std::unique_ptr<Generation>> rows;
  for (int64_t b = 0; b < in.input_ids.size(0); ++b)
    rows.push_back(std::make_unique<Generation>(model, sample_inputs(model, in, b), par, each));
  for (auto& g : rows)
    while (g->prefilling()) g->prefill_next(model, par);
  for (;;) {
    std::vector<Generation*> running;
    for (auto& g : rows)
      if (!g->done()) running.push_back(g.get());
    if (running.empty()) break;
    step_together(running, model, par);
  }
  std::vector<GenerateResult> done;
  for (auto& g : rows) done.push_back(g->finish());
  GenerateResult r = done.front();
  std::vector<at::Tensor> tokens, logits;
  for (const GenerateResult& d : done) {
    LVX_CHECK(d.tokens.size(1) == r.tokens.size(1), "generate_rows: rows generated ",
              d.tokens.size(1), " and ", r.tokens.size(1), " tokens (a stop or the context)");
    tokens.push_back(d.tokens);
    if (o.keep_logits) logits.push_back(d.step_logits);
  }
  r.tokens = at::cat(tokens, 0);
  if (o.keep_logits) r.step_logits = at::cat(logits, 0);
  return r;
}

GenerateResult generate(const models::Model& model, const models::ModelInputs& in,
                        const models::Parallel& par, const GenerateOptions& o,
                        const std::function<void(const at::Tensor&)>& on_token) {
  Generation g(model, in, par, o);
  while (g.prefilling()) g.prefill_next(model, par);
  while (!g.done()) step_together({&g}, model, par, {on_token});
  return g.finish();
}

}  // namespace lvx::runtime
