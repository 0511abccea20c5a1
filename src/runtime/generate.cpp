#include "src/runtime/generate.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>

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

GenerateResult generate(const models::Model& model, const models::ModelInputs& in,
                        const models::Parallel& par, const GenerateOptions& o,
                        const std::function<void(const at::Tensor&)>& on_token) {
  LVX_CHECK(o.max_new_tokens >= 1, "--max-new-tokens must be >= 1, got ", o.max_new_tokens);
  check_sampling(o.sampling);
  const int64_t prompt = in.input_ids.size(1);
  int64_t max_new = o.max_new_tokens;
  if (o.max_length > 0) {
    LVX_CHECK(prompt < o.max_length, "the prompt has ", prompt,
              " tokens, more than the model's context of ", o.max_length,
              " tokens leaves room for (at least one new token)");
    max_new = std::min(max_new, o.max_length - prompt);
  }
  dist::ProcessGroup& pg = *par.pg;
  using clock = std::chrono::steady_clock;
  GenerateResult r;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.sampling.seed);
  const int64_t B = in.input_ids.size(0);
  const at::Tensor stop = at::tensor(o.stop.empty() ? std::vector<int64_t>{-1} : o.stop, at::kLong);
  at::Tensor done = at::zeros({B}, at::kBool), last_stop = at::zeros({B}, at::kLong);
  std::vector<at::Tensor> tokens, logits_kept;
  models::DecodeCache cache;

  int64_t sent0 = pg.counters().total_sent();
  auto t0 = clock::now();
  at::Tensor logits;
  // Processor inputs along the sequence (OpenFlamingo's attention_mask, Mllama's
  // cross_attention_mask) would have to be cut too: such a batch runs whole.
  const int64_t split = in.named.empty() && model.can_extend()
                            ? prompt_prefix(in.input_ids, model.media_token_id())
                            : 0;
  if (split == 0) {
    logits = model.prefill(in, par, cache);
  } else {
    // The prefix as a prefill (or its state reused), then the rest as decode steps.
    const models::DecodeCache* reused = o.cached_prefix ? o.cached_prefix() : nullptr;
    if (reused != nullptr) {
      cache = *reused;  // the tensors are shared and never written; the lists are copied
      cache.encode_seconds = 0;
      r.prefix_reused = true;
    } else {
      models::ModelInputs head = in;
      head.input_ids = in.input_ids.narrow(1, 0, split);
      model.prefill(head, par, cache);
      if (o.store_prefix) o.store_prefix(cache);
    }
    r.prefix_tokens = split;
    logits = model.extend(in.input_ids.to(at::kCPU).to(at::kLong).narrow(1, split, prompt - split),
                          par, cache);
  }
  r.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  r.prefill_bytes_sent = pg.counters().total_sent() - sent0;
  r.encode_seconds = cache.encode_seconds;
  for (int64_t step = 0;; ++step) {
    if (o.keep_logits) logits_kept.push_back(logits);
    at::Tensor next = pick_tokens(logits, o.sampling, gen).to(at::kLong).contiguous();
    if (o.stop_requested) {  // rank 0's choice and its stop flag in one message
      const bool stop_now = pg.rank() == 0 && o.stop_requested();
      at::Tensor msg = at::cat({next, at::full({1}, stop_now ? 1 : 0, next.options())});
      pg.broadcast(msg, 0);
      if (msg[B].item<int64_t>() != 0) {
        r.stopped = true;
        break;
      }
      next = msg.narrow(0, 0, B).contiguous();
    } else {
      pg.broadcast(next, 0);  // rank 0's choice (sampling draws on rank 0 only matter)
    }
    next = at::where(done, last_stop, next);
    const at::Tensor is_stop = at::isin(next, stop);
    last_stop = at::where(is_stop & done.logical_not(), next, last_stop);
    done = done | is_stop;
    tokens.push_back(next);
    if (on_token) on_token(next);
    if (done.all().item<bool>()) break;
    if (step + 1 == max_new) {
      r.hit_context = max_new < o.max_new_tokens;
      break;
    }
    t0 = clock::now();
    sent0 = pg.counters().total_sent();
    logits = model.decode_step(next, par, cache);
    r.decode_bytes_sent += pg.counters().total_sent() - sent0;
    r.token_seconds.push_back(std::chrono::duration<double>(clock::now() - t0).count());
  }
  r.tokens = tokens.empty() ? at::zeros({B, 0}, at::kLong) : at::stack(tokens, 1);
  if (o.keep_logits) r.step_logits = at::stack(logits_kept, 1);
  return r;
}

}  // namespace lvx::runtime
