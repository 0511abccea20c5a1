#include "src/planner/calibrate.h"

#include <algorithm>
#include <chrono>

#include <ATen/Parallel.h>

#include "kernels/attention.h"
#include "src/common/error.h"

namespace lvx::planner {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void sync(const at::Device& device) {
  if (device.is_cuda()) {
    // A tiny host copy waits for the device's queued work (no CUDA headers needed here).
    at::zeros({1}, at::TensorOptions().device(device)).cpu();
  }
}

template <typename F>
double median_time(const at::Device& device, int reps, F fn) {
  fn();  // warm-up
  sync(device);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    double t0 = now_s();
    fn();
    sync(device);
    t.push_back(now_s() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

ThroughputSample measure_throughput(at::ScalarType dtype, const at::Device& device, int64_t s,
                                    int64_t heads, int64_t d, int64_t gemm_n, int reps,
                                    int threads, double share) {
  const int old_threads = at::get_num_threads();
  if (threads > 0) at::set_num_threads(threads);
  at::manual_seed(0);
  auto opt = at::TensorOptions().dtype(dtype).device(device);
  at::Tensor q = at::randn({1, s, heads, d}, opt), k = at::randn({1, s, heads, d}, opt);
  at::Tensor v = at::randn({1, s, heads, d}, opt), dout = at::randn({1, s, heads, d}, opt);
  kernels::AttentionParams params;
  kernels::AttentionOutput out;
  ThroughputSample r;
  r.forward_s =
      median_time(device, reps, [&] { out = kernels::attention_forward(q, k, v, params); });
  at::Tensor delta = kernels::attention_delta(dout, out.o);
  r.backward_s = median_time(
      device, reps, [&] { kernels::attention_backward(q, k, v, dout, out.lse, delta, params); });
  const double pairs = double(s) * double(s) * double(heads) * double(d);
  r.forward_flops = 4 * pairs / r.forward_s * share;
  r.backward_flops = 10 * pairs / r.backward_s * share;
  // Causal over striped positions (4 stripes): every tile is partly visible.
  {
    kernels::AttentionParams m;
    m.mask.kind = kernels::MaskKind::kCausal;
    const at::Tensor i = at::arange(s, at::kLong);
    m.mask.q_pos = m.mask.k_pos = (i % 4) * ((s + 3) / 4) + at::div(i, 4, "floor");
    kernels::AttentionOutput mo;
    const double tf = median_time(device, reps, [&] { mo = kernels::attention_forward(q, k, v, m); });
    at::Tensor md = kernels::attention_delta(dout, mo.o);
    const double tb = median_time(
        device, reps, [&] { kernels::attention_backward(q, k, v, dout, mo.lse, md, m); });
    const double visible = double(s) * double(s + 1) / 2 * double(heads) * double(d);
    r.masked_forward_flops = 4 * visible / tf * share;
    r.masked_backward_flops = 10 * visible / tb * share;
  }
  // The fixed cost of a call: 16 tokens, where the arithmetic is negligible.
  {
    const int64_t t = 16;
    at::Tensor qs = q.narrow(1, 0, t).contiguous(), ks = k.narrow(1, 0, t).contiguous();
    at::Tensor vs = v.narrow(1, 0, t).contiguous(), ds = dout.narrow(1, 0, t).contiguous();
    kernels::AttentionOutput so;
    r.forward_call_s = median_time(device, reps * 4, [&] { so = kernels::attention_forward(qs, ks, vs, params); });
    at::Tensor sd = kernels::attention_delta(ds, so.o);
    r.backward_call_s = median_time(
        device, reps * 4, [&] { kernels::attention_backward(qs, ks, vs, ds, so.lse, sd, params); });
  }
  at::Tensor a = at::randn({gemm_n, gemm_n}, opt), b = at::randn({gemm_n, gemm_n}, opt);
  double tg = median_time(device, reps, [&] { at::matmul(a, b); });
  r.gemm_flops = 2.0 * double(gemm_n) * double(gemm_n) * double(gemm_n) / tg * share;
  at::set_num_threads(old_threads);
  return r;
}

std::vector<double> measure_ring_steps(dist::ProcessGroup& pg, const std::vector<int64_t>& sizes,
                                       const at::Device& device, int reps) {
  std::vector<double> out;
  for (int64_t bytes : sizes) {
    auto opt = at::TensorOptions().dtype(at::kByte).device(device);
    at::Tensor send = at::ones({bytes}, opt), recv = at::empty({bytes}, opt);
    pg.barrier();
    out.push_back(
        median_time(device, reps, [&] { pg.ring_exchange(send, recv, "calibrate").wait(); }));
  }
  return out;
}

Link fit_link(const std::vector<int64_t>& sizes, const std::vector<double>& seconds) {
  LVX_CHECK(sizes.size() == seconds.size() && sizes.size() >= 3,
            "fit_link: expected >= 3 (size, seconds) samples, got ", sizes.size(), " and ",
            seconds.size());
  std::vector<size_t> idx(sizes.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return sizes[a] < sizes[b]; });
  const size_t a = idx[idx.size() - 2], b = idx.back();
  Link l;
  // The smallest of the small-message times: on a shared host the others are scheduling noise.
  l.latency_s = seconds[idx.front()];
  for (size_t i = 0; i < idx.size() / 2; ++i) l.latency_s = std::min(l.latency_s, seconds[idx[i]]);
  l.latency_s = std::max(l.latency_s, 1e-9);
  const double dt = seconds[b] - seconds[a];
  const double db = double(sizes[b] - sizes[a]);
  // If timing noise flattens the top of the curve, fall back to the largest message alone.
  l.bandwidth_bytes_per_s = dt > 0 ? db / dt : double(sizes[b]) / std::max(seconds[b], 1e-9);
  return l;
}

}  // namespace lvx::planner
