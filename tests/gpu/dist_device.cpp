// lvx_gpu_dist: lvx's process group on tensors of one device (LVX_TEST_DEVICE: cuda, the default,
// or cpu), one rank per process (`lvx-core launch --nproc N -- lvx_gpu_dist`; tests/gpu/run.sh).
// What it checks, on every rank:
//   engine    which engine moves CUDA tensors (ProcessGroup::cuda_engine): "nccl" when every
//             local rank has a GPU of its own, "gloo-host-staged" when ranks share one (NCCL
//             refuses two ranks per GPU), "none" at world 1; LVX_EXPECT_ENGINE, when set, must
//             match it
//   values    ring_exchange, all_gather (uneven sizes), all_reduce and broadcast on exactly
//             representable data: results equal the closed form bit for bit, on the device
//   bytes     each operation's byte counters equal its algorithm's volume (process_group.h):
//             ring S; all_gather of uneven pieces a broadcast from each owner; all_reduce
//             2(n−1)/n·S; broadcast by NCCL's ring chain or Gloo's binomial tree
//   waits     NCCL only: a ring exchange posted behind ~200 ms of GPU work on the current stream
//             returns from wait() long before that work ends (the stream waits, not the host),
//             and the received values are right once the stream is synchronised
// Exit code 0 when everything matches; each mismatch is one line on stderr.
#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>

#ifdef LVX_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

#include "src/common/device_index.h"
#include "src/dist/process_group.h"
#include "tests/collective_volumes.h"

namespace {

int bad = 0;

void expect(bool ok, int rank, const std::string& what) {
  if (ok) return;
  std::cerr << "rank " << rank << ": " << what << "\n";
  ++bad;
}

// `got` equals `want` exactly, and `got` is on `dev` (both compared on the CPU).
void expect_equal(const at::Tensor& got, const at::Tensor& want, const at::Device& dev, int rank,
                  const char* what) {
  expect(lvx::same_device(got.device(), dev), rank,
         std::string(what) + ": result on " + got.device().str() + ", expected " + dev.str());
  expect(at::equal(got.cpu(), want.cpu()), rank, std::string(what) + ": values differ");
}

// Bytes this rank sent and received during f().
template <typename F>
std::pair<int64_t, int64_t> bytes_of(lvx::dist::ProcessGroup& pg, F f) {
  pg.counters().reset();
  f();
  return {pg.counters().total_sent(), pg.counters().total_received()};
}

std::string expected_engine(const lvx::dist::ProcessGroup& pg, const at::Device& dev) {
  if (pg.world_size() == 1) return "none";
#ifdef LVX_WITH_CUDA
  const char* forced = std::getenv("LVX_DIST_CUDA_ENGINE");
  if (dev.is_cuda() && !(forced && std::string(forced) == "gloo") &&
      pg.info().local_world_size <= c10::cuda::device_count())
    return "nccl";
#endif
  (void)dev;
  return "gloo-host-staged";
}

#ifdef LVX_WITH_CUDA
int on_index(const at::Device& d) { return static_cast<int>(d.index()); }
#endif

void check_stream_ordered_wait(lvx::dist::ProcessGroup& pg, const at::Device& dev) {
#ifdef LVX_WITH_CUDA
  const int r = pg.rank();
  // ~200 ms of GPU time on the current stream (the clock rate is read, not assumed).
  int khz = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, on_index(dev)));
  const auto t0 = std::chrono::steady_clock::now();
  at::cuda::sleep(int64_t{khz} * 200);
  at::Tensor send = at::full({1 << 20}, static_cast<double>(r + 1), at::TensorOptions(dev));
  at::Tensor recv = at::empty_like(send);
  auto w = pg.ring_exchange(send, recv);
  w.wait();
  const double host_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  c10::cuda::device_synchronize();
  const double gpu_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "rank " << r << ": wait() returned after " << host_s << " s, the GPU work ended at "
            << gpu_s << " s\n";
  expect(host_s < 0.5 * gpu_s, r,
         "wait() blocked the host until the GPU work ended (" + std::to_string(host_s) + " s of " +
             std::to_string(gpu_s) + " s): NCCL waits must be stream-ordered");
  expect_equal(recv, at::full({1 << 20}, static_cast<double>(pg.prev() + 1)), dev, r,
               "ring_exchange after GPU work");
#else
  (void)pg;
  (void)dev;
#endif
}

}  // namespace

int main() {
  try {
    const char* e = std::getenv("LVX_TEST_DEVICE");
    const at::Device dev = lvx::resolve_device(at::Device(e && *e ? e : "cuda"));
#ifdef LVX_WITH_CUDA
    if (dev.is_cuda()) {
      const char* lr = std::getenv("LOCAL_RANK");
      const int local = lr ? std::atoi(lr) : 0;
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(local % c10::cuda::device_count()));
    }
#endif
    auto pg = lvx::dist::ProcessGroup::from_env();
    const int r = pg->rank(), n = pg->world_size();
    const at::Device on = dev.is_cuda() ? lvx::resolve_device(at::Device(at::kCUDA)) : dev;
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(on);
    const std::string engine = pg->cuda_engine(), want_engine = expected_engine(*pg, on);
    expect(engine == want_engine, r, "CUDA engine " + engine + ", expected " + want_engine);
    if (const char* want = std::getenv("LVX_EXPECT_ENGINE"))
      expect(engine == want, r, "CUDA engine " + engine + ", LVX_EXPECT_ENGINE=" + want);

    // ring exchange: S = 4·8·4 bytes to next, from prev.
    at::Tensor send = at::full({4, 8}, static_cast<double>(r), f32), recv = at::empty({4, 8}, f32);
    auto [s1, r1] = bytes_of(*pg, [&] { pg->ring_exchange(send, recv).wait(); });
    expect_equal(recv, at::full({4, 8}, static_cast<double>(pg->prev())), on, r, "ring_exchange");
    expect(s1 == (n > 1 ? 128 : 0) && r1 == s1, r, "ring_exchange bytes " + std::to_string(s1));

    // all_gather, uneven: rank j contributes j + 1 rows of 3.
    std::vector<int64_t> sizes;
    for (int j = 0; j < n; ++j) sizes.push_back(j + 1);
    at::Tensor all;
    auto [s2, r2] = bytes_of(*pg, [&] {
      all = pg->all_gather(at::full({r + 1, 3}, static_cast<double>(r), f32), sizes);
    });
    std::vector<at::Tensor> rows;
    for (int j = 0; j < n; ++j) rows.push_back(at::full({j + 1, 3}, static_cast<double>(j)));
    expect_equal(all, at::cat(rows), on, r, "all_gather");
    // Sizes 1..n rows. NCCL's collective: the padded ring at n = 2 (one row apart), else each
    // owner broadcasts; on Gloo (CPU or host-staged) lvx's ring of messages.
    const bool nccl = engine.rfind("nccl", 0) == 0;
    const auto [want_sent, want_received] =
        nccl ? lvx::test::all_gather_volume(r, sizes, 3 * 4, nccl)
             : lvx::test::ring_all_gather_volume(r, sizes, 3 * 4);
    expect(s2 == want_sent && r2 == want_received, r,
           "all_gather bytes sent " + std::to_string(s2) + " received " + std::to_string(r2) +
               ", expected " + std::to_string(want_sent) + " and " + std::to_string(want_received));

    // all_reduce of 24 floats (96 bytes, divisible into n chunks for n = 1..4).
    at::Tensor sum = at::full({24}, static_cast<double>(r + 1), f32);
    auto [s3, r3] = bytes_of(*pg, [&] { pg->all_reduce(sum); });
    expect_equal(sum, at::full({24}, n * (n + 1) / 2.0), on, r, "all_reduce");
    expect(s3 == 2 * (n - 1) * 96 / n && r3 == s3, r, "all_reduce bytes " + std::to_string(s3));

    // broadcast from the last rank: it sends S to each of the others.
    at::Tensor b = at::full({3}, r == n - 1 ? 7.0 : -1.0, f32);
    auto [s4, r4] = bytes_of(*pg, [&] { pg->broadcast(b, n - 1); });
    expect_equal(b, at::full({3}, 7.0), on, r, "broadcast");
    expect(s4 == lvx::test::broadcast_sends(r, n - 1, n, nccl) * 12 &&
               r4 == (r == n - 1 || n == 1 ? 0 : 12),
           r, "broadcast bytes sent " + std::to_string(s4) + " received " + std::to_string(r4));

    if (engine.rfind("nccl", 0) == 0) check_stream_ordered_wait(*pg, on);
    pg->barrier();
    std::cout << "rank " << r << " of " << n << " on " << on << ", CUDA engine " << engine << ": "
              << (bad ? "FAILED" : "ok") << "\n";
    return bad ? 1 : 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
