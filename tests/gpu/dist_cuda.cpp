// tests/gpu/run.sh: lvx's process group on CUDA tensors, one rank per process (torchrun), every
// rank on the machine's one GPU: NCCL refuses two ranks per GPU, so with more than one rank the
// messages go through Gloo staged in host memory (process_group.h); with one rank per GPU they
// go over NCCL with stream-ordered waits. Checks values and byte counters of a ring exchange,
// all_gather, all_reduce and broadcast; exit code 0 when all match.
#include <ATen/ATen.h>

#include <iostream>

#include "src/dist/process_group.h"

int main() {
  try {
    auto pg = lvx::dist::ProcessGroup::from_env();
    const int r = pg->rank(), n = pg->world_size();
    const auto cuda = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0);
    int bad = 0;
    auto expect = [&](const at::Tensor& got, const at::Tensor& want, const char* what) {
      if (!got.is_cuda() || !at::equal(got.cpu(), want.cpu())) {
        std::cerr << "rank " << r << ": " << what << " differs\n";
        ++bad;
      }
    };
    at::Tensor send = at::full({4, 8}, static_cast<double>(r), cuda);
    at::Tensor recv = at::empty({4, 8}, cuda);
    pg->ring_exchange(send, recv).wait();
    expect(recv, at::full({4, 8}, static_cast<double>(pg->prev()), cuda), "ring_exchange");
    at::Tensor all = pg->all_gather(at::full({2, 3}, static_cast<double>(r), cuda));
    at::Tensor want = at::arange(n, cuda).repeat_interleave(2).unsqueeze(1).expand({2 * n, 3});
    expect(all, want.contiguous(), "all_gather");
    at::Tensor sum = at::full({5}, static_cast<double>(r + 1), cuda);
    pg->all_reduce(sum);
    expect(sum, at::full({5}, n * (n + 1) / 2.0, cuda), "all_reduce");
    at::Tensor b = at::full({3}, static_cast<double>(r == 0 ? 7 : -1), cuda);
    pg->broadcast(b, 0);
    expect(b, at::full({3}, 7.0, cuda), "broadcast");
    std::cout << "rank " << r << " of " << n
              << ": CUDA tensors through the process group: " << (bad ? "FAILED" : "ok") << "\n";
    return bad ? 1 : 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
