// Attention masks: validation, the dense reference visibility matrix, and per-tile summaries
// that let the blockwise kernels skip tiles with no visible entry.
#include "kernels/mask.h"

#include <algorithm>
#include <limits>

#include "src/common/error.h"

namespace lvx::kernels {
namespace {

constexpr int64_t kBig = std::numeric_limits<int64_t>::max() / 4;

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

void check_meta(const at::Tensor& t, const char* name, at::ScalarType dtype,
                std::vector<int64_t> shape, const char* why) {
  LVX_CHECK(t.defined(), "attention mask: ", name, " is required for ", why);
  LVX_CHECK(t.scalar_type() == dtype, "attention mask: ", name, " must be ", at::toString(dtype),
            ", got ", at::toString(t.scalar_type()));
  LVX_CHECK(t.sizes() == at::IntArrayRef(shape), "attention mask: ", name, " must have shape ",
            at::IntArrayRef(shape), ", got ", shape_str(t));
}

void validate(const AttentionMask& mask, int64_t batch, int64_t sq, int64_t skv) {
  switch (mask.kind) {
    case MaskKind::kNone:
      break;
    case MaskKind::kCausal:
      check_meta(mask.q_pos, "q_pos", at::kLong, {sq}, "a causal mask");
      check_meta(mask.k_pos, "k_pos", at::kLong, {skv}, "a causal mask");
      break;
    case MaskKind::kMedia:
      check_meta(mask.q_media, "q_media", at::kInt, {batch, sq}, "a media mask");
      check_meta(mask.kv_media, "kv_media", at::kInt, {batch, skv}, "a media mask");
      break;
  }
  if (mask.kv_valid.defined()) {
    check_meta(mask.kv_valid, "kv_valid", at::kBool, {batch, skv}, "padding");
  }
  LVX_CHECK(!mask.unmatched_sees_all || mask.kind == MaskKind::kMedia,
            "attention mask: unmatched_sees_all is a media-mask flag (kind media), got kind ",
            mask.kind == MaskKind::kNone ? "none" : "causal");
}

// bool [B, Skv]: the keys that are padding (kv_valid false).
at::Tensor key_padding(const AttentionMask& m, int64_t batch, int64_t skv, const at::Device& dev) {
  if (m.kv_valid.defined()) return m.kv_valid.to(dev).logical_not();
  return at::zeros({batch, skv}, at::TensorOptions().device(dev).dtype(at::kBool));
}

// Per-token metadata as [B, S] int64 values and a [B, S] bool "takes no part" flag.
struct TokenMeta {
  at::Tensor value;
  at::Tensor none;
};

TokenMeta query_meta(const AttentionMask& m, int64_t batch, int64_t sq, const at::Device& dev) {
  auto opts = at::TensorOptions().device(dev);
  if (m.kind == MaskKind::kCausal) {
    auto v = m.q_pos.to(dev).unsqueeze(0).expand({batch, sq});
    return {v, at::zeros({batch, sq}, opts.dtype(at::kBool))};
  }
  if (m.kind == MaskKind::kMedia) {
    auto v = m.q_media.to(dev).to(at::kLong);
    return {v, v < 0};
  }
  return {at::zeros({batch, sq}, opts.dtype(at::kLong)),
          at::zeros({batch, sq}, opts.dtype(at::kBool))};
}

TokenMeta key_meta(const AttentionMask& m, int64_t batch, int64_t skv, const at::Device& dev) {
  auto opts = at::TensorOptions().device(dev);
  TokenMeta t;
  if (m.kind == MaskKind::kCausal) {
    t = {m.k_pos.to(dev).unsqueeze(0).expand({batch, skv}),
         at::zeros({batch, skv}, opts.dtype(at::kBool))};
  } else if (m.kind == MaskKind::kMedia) {
    auto v = m.kv_media.to(dev).to(at::kLong);
    t = {v, v < 0};
  } else {
    t = {at::zeros({batch, skv}, opts.dtype(at::kLong)),
         at::zeros({batch, skv}, opts.dtype(at::kBool))};
  }
  if (m.kv_valid.defined()) t.none = t.none | m.kv_valid.to(dev).logical_not();
  return t;
}

// Reduces [B, S] token metadata to [B, n_tiles] summaries; the padding past S in the last tile
// is neutral (lo +big, hi -big, has_none false, all_none true).
void summarize(const TokenMeta& t, int64_t tile, at::Tensor& lo, at::Tensor& hi,
               at::Tensor& has_none, at::Tensor& all_none) {
  const int64_t batch = t.value.size(0), s = t.value.size(1);
  const int64_t n = (s + tile - 1) / tile, pad = n * tile - s;
  auto lo_v = at::where(t.none, at::full({}, kBig, t.value.options()), t.value);
  auto hi_v = at::where(t.none, at::full({}, -kBig, t.value.options()), t.value);
  auto padded = [&](const at::Tensor& x, const at::Scalar& fill) {
    if (pad == 0) return x.reshape({batch, n, tile});
    auto extra = at::full({batch, pad}, fill, x.options());
    return at::cat({x, extra}, 1).reshape({batch, n, tile});
  };
  lo = padded(lo_v, kBig).amin(2).contiguous();
  hi = padded(hi_v, -kBig).amax(2).contiguous();
  has_none = padded(t.none, false).any(2).contiguous();
  all_none = padded(t.none, true).all(2).contiguous();
}

}  // namespace

TileSummary PreparedMask::q_summary(int64_t b, int64_t t) const {
  const int64_t i = b * n_q_tiles + t;
  TileSummary s{q_lo.data_ptr<int64_t>()[i], q_hi.data_ptr<int64_t>()[i],
                q_has_none.data_ptr<bool>()[i], q_all_none.data_ptr<bool>()[i]};
  s.has_all = view.see_all && s.has_none;
  s.all_all = view.see_all && s.all_none;
  return s;
}

TileSummary PreparedMask::k_summary(int64_t b, int64_t t) const {
  const int64_t i = b * n_k_tiles + t;
  TileSummary s{k_lo.data_ptr<int64_t>()[i], k_hi.data_ptr<int64_t>()[i],
                k_has_none.data_ptr<bool>()[i], k_all_none.data_ptr<bool>()[i]};
  if (view.see_all) {
    s.has_pad = k_has_pad.data_ptr<bool>()[i];
    s.all_pad = k_all_pad.data_ptr<bool>()[i];
  }
  return s;
}

PreparedMask prepare_mask(const AttentionMask& mask, int64_t batch, int64_t sq, int64_t skv,
                          int64_t q_tile, int64_t k_tile, const at::Device& device) {
  validate(mask, batch, sq, skv);
  PreparedMask p;
  p.q_tile = q_tile;
  p.k_tile = k_tile;
  p.n_q_tiles = (sq + q_tile - 1) / q_tile;
  p.n_k_tiles = (skv + k_tile - 1) / k_tile;
  MaskView& v = p.view;
  v.kind = static_cast<int>(mask.kind);
  v.rule = static_cast<int>(mask.media_rule);
  v.see_all = mask.unmatched_sees_all;
  v.sq = sq;
  v.skv = skv;
  if (mask.kind == MaskKind::kCausal) {
    p.keep_[0] = mask.q_pos.to(device).contiguous();
    p.keep_[1] = mask.k_pos.to(device).contiguous();
    v.q_pos = p.keep_[0].data_ptr<int64_t>();
    v.k_pos = p.keep_[1].data_ptr<int64_t>();
  } else if (mask.kind == MaskKind::kMedia) {
    p.keep_[2] = mask.q_media.to(device).contiguous();
    p.keep_[3] = mask.kv_media.to(device).contiguous();
    v.q_media = p.keep_[2].data_ptr<int32_t>();
    v.kv_media = p.keep_[3].data_ptr<int32_t>();
  }
  if (mask.kv_valid.defined()) {
    p.keep_[4] = mask.kv_valid.to(device).contiguous();
    v.kv_valid = p.keep_[4].data_ptr<bool>();
  }
  if (sq > 0) {
    summarize(query_meta(mask, batch, sq, device), q_tile, p.q_lo, p.q_hi, p.q_has_none,
              p.q_all_none);
  }
  if (skv > 0) {
    summarize(key_meta(mask, batch, skv, device), k_tile, p.k_lo, p.k_hi, p.k_has_none,
              p.k_all_none);
    if (mask.unmatched_sees_all) {
      const at::Tensor pad = key_padding(mask, batch, skv, device);
      at::Tensor lo, hi;
      summarize({at::zeros_like(pad, pad.options().dtype(at::kLong)), pad}, k_tile, lo, hi,
                p.k_has_pad, p.k_all_pad);
    }
  }
  return p;
}

at::Tensor mask_matrix(const AttentionMask& mask, int64_t batch, int64_t sq, int64_t skv) {
  validate(mask, batch, sq, skv);
  at::Device dev = at::kCPU;
  for (const at::Tensor* t : {&mask.q_pos, &mask.q_media, &mask.kv_valid}) {
    if (t->defined()) dev = t->device();
  }
  const TokenMeta q = query_meta(mask, batch, sq, dev), k = key_meta(mask, batch, skv, dev);
  const bool exact = rule_is_exact(static_cast<int>(mask.kind), static_cast<int>(mask.media_rule));
  at::Tensor vis = rule_visible(exact, q.value.unsqueeze(2), k.value.unsqueeze(1));
  vis = vis & q.none.logical_not().unsqueeze(2) & k.none.logical_not().unsqueeze(1);
  if (!mask.unmatched_sees_all) return vis;
  const at::Tensor real_keys = key_padding(mask, batch, skv, dev).logical_not();
  return vis | (q.none.unsqueeze(2) & real_keys.unsqueeze(1));
}

namespace {

// Summed over the queries `qs`: how many of `keys` are <= each (exact: == each); both int, any
// order. A histogram's prefix sums where the keys' values span little (media indices, a
// sequence's positions; the cost model counts blocks of ~10^5 keys many times), else sorting and
// binary search: O(Sq + Skv + span) or O((Sq + Skv) log Skv).
int64_t keys_at_or_below(const at::Tensor& keys, const at::Tensor& qs, bool exact) {
  if (keys.numel() == 0 || qs.numel() == 0) return 0;
  const at::Tensor k = keys.to(at::kLong), q = qs.to(at::kLong);
  const int64_t lo = k.min().item<int64_t>(), span = k.max().item<int64_t>() - lo + 1;
  if (span <= std::max<int64_t>(int64_t{1} << 18, 4 * (k.numel() + q.numel()))) {
    const at::Tensor le = at::cumsum(at::bincount(k - lo, {}, span), 0);  // keys <= lo + i
    auto count_le = [&](const at::Tensor& v) {
      const at::Tensor i = v - lo;
      return at::where(i < 0, at::zeros({}, le.options()),
                       le.index_select(0, i.clamp(0, span - 1)));
    };
    at::Tensor n = count_le(q);
    if (exact) n = n - count_le(q - 1);
    return n.sum().item<int64_t>();
  }
  const at::Tensor sorted = std::get<0>(k.sort());
  at::Tensor n = at::searchsorted(sorted, q, /*out_int32=*/false, /*right=*/true);
  if (exact) n = n - at::searchsorted(sorted, q, false, /*right=*/false);
  return n.sum().item<int64_t>();
}

}  // namespace

int64_t visible_pairs(const AttentionMask& mask, int64_t batch, int64_t sq, int64_t skv) {
  validate(mask, batch, sq, skv);
  if (mask.kind == MaskKind::kNone && !mask.kv_valid.defined()) return batch * sq * skv;
  const at::Device dev = at::kCPU;
  const TokenMeta q = query_meta(mask, batch, sq, dev), k = key_meta(mask, batch, skv, dev);
  const bool exact = rule_is_exact(static_cast<int>(mask.kind), static_cast<int>(mask.media_rule));
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    // rule_visible's interval form: #keys with k <= q, less those with k < q when exact.
    total += keys_at_or_below(k.value[b].masked_select(k.none[b].logical_not()),
                              q.value[b].masked_select(q.none[b].logical_not()), exact);
    if (mask.unmatched_sees_all) {  // each unmatched query sees every non-padding key
      const at::Tensor keys_real = key_padding(mask, batch, skv, dev)[b].logical_not().sum();
      total += q.none[b].sum().item<int64_t>() * keys_real.item<int64_t>();
    }
  }
  return total;
}

}  // namespace lvx::kernels
