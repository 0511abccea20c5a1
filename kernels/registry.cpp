// The device table of attention implementations. The only #ifdef on CUDA in kernels/: a
// static library drops object files nobody references, so the table names the CUDA entry
// here instead of relying on a static initializer in the .cu file.
#include "kernels/registry.h"

#include "kernels/attention_gemm.h"

namespace lvx::kernels {

const AttentionImpl* find_attention_impl(c10::DeviceType device) {
  static const AttentionImpl cpu{"cpu",
                                 attention_forward_dispatch_cpu,
                                 attention_backward_dispatch_cpu,
                                 merge_attention_states_cpu,
                                 softmax_chunk_forward_cpu,
                                 softmax_chunk_backward_cpu};
  if (device == c10::DeviceType::CPU) return &cpu;
  static const AttentionImpl meta{
      "meta", attention_forward_meta, attention_backward_meta, merge_attention_states_meta, nullptr,
      nullptr};
  if (device == c10::DeviceType::Meta) return &meta;
#ifdef LVX_WITH_CUDA
  static const AttentionImpl cuda = cuda_attention_impl();
  if (device == c10::DeviceType::CUDA) return &cuda;
#endif
  return nullptr;
}

}  // namespace lvx::kernels
