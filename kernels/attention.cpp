// The public attention ops: argument checks with messages that name the tensor, the expected and
// the actual value, then dispatch to the implementation registered for q's device.
#include "kernels/attention.h"

#include <cmath>

#include "kernels/registry.h"
#include "src/common/device_index.h"
#include "src/common/error.h"

namespace lvx::kernels {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

void check_4d(const at::Tensor& t, const char* name, const char* layout) {
  LVX_CHECK(t.defined(), "attention: ", name, " is undefined");
  LVX_CHECK(t.dim() == 4, "attention: ", name, " must be 4-D ", layout, ", got shape ",
            shape_str(t));
  LVX_CHECK(is_supported_float(t.scalar_type()), "attention: ", name,
            " must be float32, float64, bfloat16 or float16, got ", at::toString(t.scalar_type()));
}

const AttentionImpl& impl_for(const at::Tensor& q) {
  const AttentionImpl* impl = find_attention_impl(q.device().type());
  LVX_CHECK(impl != nullptr, "attention: no kernel for device ", q.device(),
            " (CUDA kernels are compiled only with -DLVX_CUDA=ON)");
  return *impl;
}

struct Dims {
  int64_t b, sq, hq, d, skv, hkv;
};

Dims check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_4d(q, "q", "[B, Sq, Hq, D]");
  check_4d(k, "k", "[B, Skv, Hkv, D]");
  check_4d(v, "v", "[B, Skv, Hkv, D]");
  Dims d{q.size(0), q.size(1), q.size(2), q.size(3), k.size(1), k.size(2)};
  LVX_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
            "attention: q, k and v must share a dtype, got q ", at::toString(q.scalar_type()),
            ", k ", at::toString(k.scalar_type()), ", v ", at::toString(v.scalar_type()));
  LVX_CHECK(same_device(k.device(), q.device()) && same_device(v.device(), q.device()),
            "attention: q, k and v must be on one device, got q on ", q.device(), ", k on ",
            k.device(), ", v on ", v.device());
  LVX_CHECK(k.size(0) == d.b, "attention: k has batch ", k.size(0), ", expected q's batch ", d.b);
  LVX_CHECK(k.size(3) == d.d, "attention: k has head dim ", k.size(3), ", expected q's head dim ",
            d.d);
  LVX_CHECK(v.sizes() == k.sizes(), "attention: v must have k's shape ", shape_str(k), ", got ",
            shape_str(v));
  LVX_CHECK(d.hkv > 0 && d.hq % d.hkv == 0, "attention: k has ", d.hkv,
            " heads, which does not divide q's ", d.hq, " heads");
  LVX_CHECK(d.d > 0, "attention: head dim must be positive, got ", d.d);
  return d;
}

double resolve_scale(const AttentionParams& p, int64_t d) {
  LVX_CHECK(p.scale >= 0 && std::isfinite(p.scale),
            "attention: scale must be finite and >= 0 (0 means 1/sqrt(D)), got ", p.scale);
  return p.scale == 0 ? 1.0 / std::sqrt(static_cast<double>(d)) : p.scale;
}

at::Tensor stat_arg(const at::Tensor& t, const char* name, const Dims& d, at::ScalarType acc,
                    const at::Device& dev) {
  LVX_CHECK(t.defined(), "attention_backward: ", name, " is undefined");
  LVX_CHECK(t.dim() == 3 && t.size(0) == d.b && t.size(1) == d.hq && t.size(2) == d.sq,
            "attention_backward: ", name, " must have shape [B, Hq, Sq] = [", d.b, ", ", d.hq, ", ",
            d.sq, "], got ", shape_str(t));
  LVX_CHECK(same_device(t.device(), dev), "attention_backward: ", name, " must be on ", dev, ", got ",
            t.device());
  return t.to(acc).contiguous();
}

}  // namespace

at::ScalarType accumulation_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

AttentionOutput attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionParams& params) {
  return attention_forward(q, k, v, params, nullptr);
}

AttentionOutput attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionParams& params, AttentionStats* stats) {
  const Dims d = check_qkv(q, k, v);
  const double scale = resolve_scale(params, d.d);
  return impl_for(q).forward(q.contiguous(), k.contiguous(), v.contiguous(), scale, params.mask,
                             stats);
}

AttentionGrads attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& dout, const at::Tensor& lse,
                                  const at::Tensor& delta, const AttentionParams& params) {
  return attention_backward(q, k, v, dout, lse, delta, params, nullptr);
}

AttentionGrads attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& dout, const at::Tensor& lse,
                                  const at::Tensor& delta, const AttentionParams& params,
                                  AttentionStats* stats) {
  const Dims d = check_qkv(q, k, v);
  check_4d(dout, "dout", "[B, Sq, Hq, D]");
  LVX_CHECK(dout.sizes() == q.sizes(), "attention_backward: dout must have q's shape ",
            shape_str(q), ", got ", shape_str(dout));
  LVX_CHECK(same_device(dout.device(), q.device()), "attention_backward: dout must be on ", q.device(),
            ", got ", dout.device());
  const auto acc = accumulation_dtype(q.scalar_type());
  const double scale = resolve_scale(params, d.d);
  return impl_for(q).backward(
      q.contiguous(), k.contiguous(), v.contiguous(), dout.to(q.scalar_type()).contiguous(),
      stat_arg(lse, "lse", d, acc, q.device()), stat_arg(delta, "delta", d, acc, q.device()), scale,
      params.mask, stats);
}

at::Tensor attention_delta(const at::Tensor& dout, const at::Tensor& o) {
  check_4d(dout, "dout", "[B, Sq, Hq, D]");
  check_4d(o, "o", "[B, Sq, Hq, D]");
  LVX_CHECK(dout.sizes() == o.sizes(), "attention_delta: dout must have o's shape ", shape_str(o),
            ", got ", shape_str(dout));
  const bool f64 = dout.scalar_type() == at::kDouble || o.scalar_type() == at::kDouble;
  const auto acc = f64 ? at::kDouble : at::kFloat;
  // [B, Sq, Hq] -> [B, Hq, Sq]
  return (dout.to(acc) * o.to(acc)).sum(-1).transpose(1, 2).contiguous();
}

void merge_attention_states(at::Tensor& o_acc, at::Tensor& lse_acc, const at::Tensor& o_new,
                            const at::Tensor& lse_new) {
  check_4d(o_acc, "o_acc", "[B, Sq, H, D]");
  check_4d(o_new, "o_new", "[B, Sq, H, D]");
  const auto acc = o_acc.scalar_type();
  LVX_CHECK(acc == at::kFloat || acc == at::kDouble,
            "merge_attention_states: o_acc must be float32 or float64 (the accumulation dtype), "
            "got ",
            at::toString(acc));
  LVX_CHECK(lse_acc.defined() && lse_acc.scalar_type() == acc,
            "merge_attention_states: lse_acc must have o_acc's dtype ", at::toString(acc), ", got ",
            lse_acc.defined() ? at::toString(lse_acc.scalar_type()) : "undefined");
  LVX_CHECK(o_new.sizes() == o_acc.sizes(),
            "merge_attention_states: o_new must have o_acc's "
            "shape ",
            shape_str(o_acc), ", got ", shape_str(o_new));
  const std::vector<int64_t> lse_shape{o_acc.size(0), o_acc.size(2), o_acc.size(1)};
  LVX_CHECK(lse_acc.sizes() == at::IntArrayRef(lse_shape),
            "merge_attention_states: lse_acc must have shape [B, H, Sq] = ",
            at::IntArrayRef(lse_shape), ", got ", shape_str(lse_acc));
  LVX_CHECK(
      lse_new.defined() && lse_new.sizes() == at::IntArrayRef(lse_shape),
      "merge_attention_states: lse_new must have shape [B, H, Sq] = ", at::IntArrayRef(lse_shape),
      ", got ", lse_new.defined() ? shape_str(lse_new) : "undefined");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&lse_acc), &o_new, &lse_new}) {
    LVX_CHECK(same_device(t->device(), o_acc.device()), "merge_attention_states: all tensors must be on ",
              o_acc.device(), ", got one on ", t->device());
  }
  const AttentionImpl& impl = impl_for(o_acc);
  // Work on contiguous buffers; write back only when the caller's tensors are views.
  at::Tensor o = o_acc.is_contiguous() ? o_acc : o_acc.contiguous();
  at::Tensor l = lse_acc.is_contiguous() ? lse_acc : lse_acc.contiguous();
  impl.merge(o, l, o_new.to(acc).contiguous(), lse_new.to(acc).contiguous());
  if (!o_acc.is_contiguous()) o_acc.copy_(o);
  if (!lse_acc.is_contiguous()) lse_acc.copy_(l);
}

}  // namespace lvx::kernels
