// Shape-only attention on PyTorch's `meta` device: the entry lvx's placement check runs on
// (tests/test_models_placement.cpp runs both model families' forward, backward, prefill and
// decode on meta, where every mixed-device op fails). Outputs have the shapes, dtypes and device
// of the CPU/CUDA kernels' (kernels/attention.h), no values. Mask tensors that the kernels read
// per element (media indices, padding) must be on q's device, as a CUDA kernel needs them; causal
// positions are layout metadata the kernels may take from the host.
#include <ATen/ATen.h>

#include "kernels/registry.h"
#include "src/common/device_index.h"
#include "src/common/error.h"

namespace lvx::kernels {

namespace {

void check_mask_device(const AttentionMask& mask, const at::Tensor& q, const char* op) {
  for (const auto& [t, name] :
       {std::pair{&mask.q_media, "q_media"}, std::pair{&mask.kv_media, "kv_media"},
        std::pair{&mask.kv_valid, "kv_valid"}})
    LVX_CHECK(!t->defined() || same_device(t->device(), q.device()), op, ": mask ", name, " must be on ",
              q.device(), " (q's device), got ", t->device());
}

}  // namespace

AttentionOutput attention_forward_meta(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, double, const AttentionMask& mask,
                                       AttentionStats*) {
  check_mask_device(mask, q, "attention_forward");
  (void)k;
  (void)v;
  const auto opts = q.options().dtype(accumulation_dtype(q.scalar_type()));
  return {at::empty(q.sizes(), opts), at::empty({q.size(0), q.size(2), q.size(1)}, opts)};
}

AttentionGrads attention_backward_meta(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&, double, const AttentionMask& mask,
                                       AttentionStats*) {
  check_mask_device(mask, q, "attention_backward");
  const auto acc = accumulation_dtype(q.scalar_type());
  return {at::empty(q.sizes(), q.options().dtype(acc)),
          at::empty(k.sizes(), k.options().dtype(acc)),
          at::empty(v.sizes(), v.options().dtype(acc))};
}

void merge_attention_states_meta(at::Tensor& o_acc, at::Tensor& lse_acc, const at::Tensor& o_new,
                                 const at::Tensor& lse_new) {
  // The same ops' shapes and devices as the real merge: a mixed device fails here too.
  const at::Tensor lse = at::logaddexp(lse_acc, lse_new);
  o_acc.copy_(o_acc + o_new);
  lse_acc.copy_(lse);
}

}  // namespace lvx::kernels
