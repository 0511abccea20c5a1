#include "src/planner/calibrate.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "kernels/attention.h"
#include "kernels/cpu_path.h"
#include "kernels/registry.h"
#include "src/common/device_sync.h"
#include "src/common/error.h"

namespace lvx::planner {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename F>
double median_time(const at::Device& device, int reps, F fn) {
  fn();  // warm-up
  lvx::synchronize(device);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    double t0 = now_s();
    fn();
    lvx::synchronize(device);
    t.push_back(now_s() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

std::vector<CpuPathSample> measure_cpu_paths(const std::vector<std::pair<int64_t, int64_t>>& shapes,
                                             int64_t heads, int64_t d, int reps, int threads) {
  const int old_threads = at::get_num_threads();
  if (threads > 0) at::set_num_threads(threads);
  at::manual_seed(0);
  const at::Device cpu(at::kCPU);
  const kernels::AttentionParams params;
  auto timed = [&](kernels::CpuPath path, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& dout) {
    kernels::set_cpu_attention_choices({{1.0, path}});
    return median_time(cpu, reps, [&] {
      const kernels::AttentionOutput o = kernels::attention_forward(q, k, v, params);
      kernels::attention_backward(q, k, v, dout, o.lse, kernels::attention_delta(dout, o.o),
                                  params);
    });
  };
  std::vector<CpuPathSample> out;
  for (const auto& [sq, skv] : shapes) {
    const at::Tensor q = at::randn({1, sq, heads, d}), dout = at::randn({1, sq, heads, d});
    const at::Tensor k = at::randn({1, skv, heads, d}), v = at::randn({1, skv, heads, d});
    out.push_back({sq, skv, timed(kernels::CpuPath::kFused, q, k, v, dout),
                   timed(kernels::CpuPath::kGemm, q, k, v, dout)});
  }
  kernels::set_cpu_attention_choices({});
  at::set_num_threads(old_threads);
  return out;
}

std::vector<CpuAttentionChoice> choose_cpu_paths(const std::vector<CpuPathSample>& samples) {
  std::vector<CpuAttentionChoice> out;
  for (const CpuPathSample& s : samples)
    out.push_back({static_cast<double>(s.skv) / static_cast<double>(s.sq),
                   s.gemm_s < s.fused_s ? "gemm" : "fused", s.fused_s * 1e3, s.gemm_s * 1e3});
  return out;
}

double measure_read_bandwidth(const at::Device& device, int reps, int threads) {
  const int old_threads = at::get_num_threads();
  if (threads > 0) at::set_num_threads(threads);
  const int64_t n = int64_t{128} << 20;  // 512 MiB of fp32
  const at::Tensor x = at::ones({n}, at::TensorOptions().dtype(at::kFloat).device(device));
  at::Tensor sum;
  const double s = median_time(device, reps, [&] { sum = x.sum(); });
  at::set_num_threads(old_threads);
  return double(n) * 4 / s;
}

ThroughputSample measure_throughput(at::ScalarType dtype, const at::Device& device, int64_t s,
                                    int64_t heads, int64_t d, int64_t gemm_n, int reps, int threads,
                                    double share) {
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
  // Three unmasked calls fix the model time = c + T·H·t + F/rate (c per call, t per computed
  // tile and head, F the FLOPs): 16 queries × 16 keys (1 tile per head), 16 × 16 tiles' worth of
  // keys (16 tiles), and s × s (the throughput problem). Times are in a rank's units (share).
  const int64_t few = 16, wide = 16 * kernels::kCpuKTile;
  at::Tensor kw = at::randn({1, wide, heads, d}, opt), vw = at::randn({1, wide, heads, d}, opt);
  at::Tensor qf = q.narrow(1, 0, few).contiguous(), df = dout.narrow(1, 0, few).contiguous();
  at::Tensor kf = k.narrow(1, 0, few).contiguous(), vf = v.narrow(1, 0, few).contiguous();
  std::vector<KernelSample> fwd, bwd;  // the same three calls, forward and backward
  auto sample = [&](const at::Tensor& qq, const at::Tensor& kk, const at::Tensor& vv,
                    const at::Tensor& dd, int r_) {
    kernels::AttentionOutput o_;
    const double tf =
        median_time(device, r_, [&] { o_ = kernels::attention_forward(qq, kk, vv, params); });
    at::Tensor de = kernels::attention_delta(dd, o_.o);
    const double tb = median_time(
        device, r_, [&] { kernels::attention_backward(qq, kk, vv, dd, o_.lse, de, params); });
    fwd.push_back({qq.size(1), kk.size(1), tf / share});
    bwd.push_back({qq.size(1), kk.size(1), tb / share});
  };
  sample(qf, kf, vf, df, reps * 4);
  sample(qf, kw, vw, df, reps * 2);
  fwd.push_back({s, s, r.forward_s / share});
  bwd.push_back({s, s, r.backward_s / share});
  const KernelCostFit ff = fit_kernel_cost(fwd, heads, d, 4),
                      fb = fit_kernel_cost(bwd, heads, d, 10);
  AttentionThroughput& a = r.attention;
  a.forward_call_s = ff.call_s;
  a.forward_tile_s = ff.tile_s;
  a.forward_flops = ff.flops;
  a.backward_call_s = fb.call_s;
  a.backward_tile_s = fb.tile_s;
  a.backward_flops = fb.flops;
  // Causal over permuted positions (4 interleaved stripes, so no tile's positions are ordered):
  // every tile is partly visible, computed whole and masked entry by entry: the extra per tile.
  {
    kernels::AttentionParams m;
    m.mask.kind = kernels::MaskKind::kCausal;
    const at::Tensor i = at::arange(s, at::kLong);
    m.mask.q_pos = m.mask.k_pos = (i % 4) * ((s + 3) / 4) + at::div(i, 4, "floor");
    kernels::AttentionOutput mo;
    const double tf =
        median_time(device, reps, [&] { mo = kernels::attention_forward(q, k, v, m); }) / share;
    at::Tensor md = kernels::attention_delta(dout, mo.o);
    const double tb =
        median_time(device, reps,
                    [&] { kernels::attention_backward(q, k, v, dout, mo.lse, md, m); }) /
        share;
    const double visible = double(s) * double(s + 1) / 2 * double(heads) * double(d);
    const double tiles = double(kernels::cpu_tiles(s, s) * heads);
    a.forward_masked_tile_s = std::max(
        0.0,
        (tf - a.forward_call_s - tiles * a.forward_tile_s - 4 * visible / a.forward_flops) / tiles);
    a.backward_masked_tile_s = std::max(0.0, (tb - a.backward_call_s - tiles * a.backward_tile_s -
                                              10 * visible / a.backward_flops) /
                                                 tiles);
  }
  at::Tensor ga = at::randn({gemm_n, gemm_n}, opt), gb = at::randn({gemm_n, gemm_n}, opt);
  double tg = median_time(device, reps, [&] { at::matmul(ga, gb); });
  r.gemm_flops = 2.0 * double(gemm_n) * double(gemm_n) * double(gemm_n) / tg * share;
  at::set_num_threads(old_threads);
  return r;
}

KernelCostFit fit_kernel_cost(const std::vector<KernelSample>& xs, int64_t heads, int64_t d,
                              double flops_per_pair) {
  LVX_CHECK(xs.size() == 3, "fit_kernel_cost: expected 3 samples, got ", xs.size());
  // [1, T·H, k·Sq·Sk·H·d] · [c, t, 1/rate] = seconds, by Gaussian elimination (partial pivoting).
  double M[3][4];
  for (int i = 0; i < 3; ++i) {
    const KernelSample& x = xs[static_cast<size_t>(i)];
    M[i][0] = 1;
    M[i][1] = double(kernels::cpu_tiles(x.sq, x.sk) * heads);
    M[i][2] = flops_per_pair * double(x.sq) * double(x.sk) * double(heads) * double(d);
    M[i][3] = x.seconds;
  }
  for (int c = 0; c < 3; ++c) {
    int piv = c;
    for (int r = c + 1; r < 3; ++r)
      if (std::abs(M[r][c]) > std::abs(M[piv][c])) piv = r;
    std::swap(M[c], M[piv]);
    LVX_CHECK(M[c][c] != 0, "fit_kernel_cost: the samples do not separate the terms");
    for (int r = 0; r < 3; ++r) {
      if (r == c) continue;
      const double f = M[r][c] / M[c][c];
      for (int j = c; j < 4; ++j) M[r][j] -= f * M[c][j];
    }
  }
  KernelCostFit out;
  const double inv_rate = M[2][3] / M[2][2];
  // The largest sample's plain throughput: what stands when noise makes the fit unphysical.
  const KernelSample& big = *std::max_element(
      xs.begin(), xs.end(), [](const auto& a, const auto& b) { return a.sq * a.sk < b.sq * b.sk; });
  const double plain =
      flops_per_pair * double(big.sq) * double(big.sk) * double(heads) * double(d) / big.seconds;
  if (!(inv_rate > 0)) {
    out.flops = plain;
    return out;
  }
  out.call_s = std::max(0.0, M[0][3] / M[0][0]);
  out.tile_s = std::max(0.0, M[1][3] / M[1][1]);
  out.flops = std::max(plain, 1.0 / inv_rate);
  return out;
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

std::vector<double> measure_pair_exchanges(dist::ProcessGroup& pg, int peer,
                                           const std::vector<int64_t>& sizes,
                                           const at::Device& device, int reps) {
  std::vector<double> out;
  auto opt = at::TensorOptions().dtype(at::kByte).device(device);
  for (int64_t bytes : sizes) {
    at::Tensor send = at::ones({bytes}, opt), recv = at::empty({bytes}, opt);
    std::vector<double> t;
    for (int r = 0; r < reps + 1; ++r) {
      pg.barrier();  // every pair starts together: pairs that share a link share it throughout
      const double t0 = now_s();
      if (peer >= 0)
        pg.batch_isend_irecv({dist::P2POp::send(send, peer), dist::P2POp::recv(recv, peer)},
                             "calibrate")
            .wait();
      lvx::synchronize(device);
      pg.barrier();  // until the last pair is done: flows sharing a link finish unevenly
      if (r > 0) t.push_back(now_s() - t0);  // the first is a warm-up
    }
    std::sort(t.begin(), t.end());
    out.push_back(t[t.size() / 2]);
  }
  return out;
}

double measure_collective_after_compute(dist::ProcessGroup& pg, const at::Device& device,
                                        int reps, double compute_s) {
  const int n = pg.world_size();
  auto opt = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor a = at::randn({128, 128}, opt), x = at::zeros({n * 256}, opt);
  const std::vector<int64_t> split(n, 256);
  std::vector<double> times;
  for (int r = 0; r < reps + 1; ++r) {
    pg.barrier();
    const auto start = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
           compute_s)
      a = at::matmul(a, a).mul_(1.0 / 128);
    lvx::synchronize(device);
    const auto t0 = std::chrono::steady_clock::now();
    pg.all_to_all(x, split, split);
    lvx::synchronize(device);
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) times.push_back(t);  // the first is a warm-up
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
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
  // When the largest message takes far longer than the latency (a slow or shaped link), it alone
  // gives the bandwidth: the slope between the two largest would add both samples' noise (on a
  // shared host, ±20 % through a shaped link). Otherwise the slope, where α no longer matters.
  if (seconds[b] > 20 * l.latency_s) {
    l.bandwidth_bytes_per_s = double(sizes[b]) / (seconds[b] - l.latency_s);
    return l;
  }
  const double dt = seconds[b] - seconds[a];
  const double db = double(sizes[b] - sizes[a]);
  // If timing noise flattens the top of the curve, fall back to the largest message alone.
  l.bandwidth_bytes_per_s = dt > 0 ? db / dt : double(sizes[b]) / std::max(seconds[b], 1e-9);
  return l;
}

}  // namespace lvx::planner
