#include "models/parallel.h"

#include "src/common/error.h"

namespace lvx::models {

Parallel resolve_layouts(Parallel p) {
  using attention::StrategyKind;
  // Any striped choice, self or cross, stripes the text (every layer's queries), as the planner
  // prices it (planner::CostOptions::text_layout); the keys of a cross layer are striped whole
  // images anyway (media_layout).
  bool striped = false;
  for (const auto& l : p.layers)
    for (const attention::StrategyChoice& c : {l.self, l.cross})
      striped = striped || c.forward == StrategyKind::kStriped ||
                c.backward == StrategyKind::kStriped;
  if (striped) p.text_layout = attention::LayoutKind::kStriped;
  auto as_ring = [](attention::StrategyChoice c) {
    if (c.forward == StrategyKind::kStriped) c.forward = StrategyKind::kRing;
    if (c.backward == StrategyKind::kStriped) c.backward = StrategyKind::kRing;
    return c;
  };
  for (auto& l : p.layers) {
    l.self = as_ring(l.self);
    l.cross = as_ring(l.cross);
  }
  return p;
}

TextShard embed_text_shard(const at::Tensor& input_ids, const at::Tensor& embedding,
                           const Parallel& par, const std::string& model) {
  LVX_CHECK(input_ids.dim() == 2 && input_ids.scalar_type() == at::kLong, model,
            ": input_ids must be int64 [B, L], got ", input_ids.scalar_type(), " ",
            input_ids.sizes());
  const attention::Layout text{par.text_layout, input_ids.size(1), par.world()};
  TextShard t;
  // The layout's indices are made on the host; the ids may be on the host or the device.
  t.host_positions = text.positions(par.rank());
  t.positions = t.host_positions.to(embedding.device());
  t.hidden = at::embedding(
      embedding,
      input_ids.index_select(1, t.host_positions.to(input_ids.device())).to(embedding.device()));
  return t;
}

attention::AttentionSpec self_attention_spec(int64_t batch, int64_t length, int64_t heads,
                                             int64_t kv_heads, int64_t head_dim,
                                             const Parallel& par) {
  attention::AttentionSpec s;
  s.batch = batch;
  s.sq = s.skv = length;
  s.hq = heads;
  s.hkv = kv_heads;
  s.head_dim = head_dim;
  s.mask = kernels::MaskKind::kCausal;
  s.q_layout = s.kv_layout = par.text_layout;
  return s;
}

attention::AttentionSpec cross_attention_spec(int64_t batch, int64_t length, int64_t heads,
                                              int64_t kv_heads, int64_t head_dim,
                                              const attention::MediaMask& mm, const Parallel& par) {
  attention::AttentionSpec s = self_attention_spec(batch, length, heads, kv_heads, head_dim, par);
  s.skv = mm.slots * mm.tokens_per_media;
  s.mask = kernels::MaskKind::kMedia;
  s.media_rule = mm.rule;
  s.unmatched_sees_all = mm.unmatched_sees_all;
  s.kv_layout = media_layout(mm.slots, mm.tokens_per_media, par.world()).kind;
  s.kv_unit = mm.tokens_per_media;
  return s;
}

attention::Layout media_layout(int64_t slots, int64_t tokens_per_media, int world) {
  return attention::Layout{attention::LayoutKind::kStriped, slots * tokens_per_media, world,
                           tokens_per_media};
}

std::vector<int64_t> media_slots(int64_t slots, int rank, int world) {
  const at::Tensor s = media_layout(slots, 1, world).positions(rank);
  return std::vector<int64_t>(s.data_ptr<int64_t>(), s.data_ptr<int64_t>() + s.numel());
}

at::Tensor LocalMedia::slot_index() const { return at::tensor(slots, at::kLong); }

at::Tensor LocalMedia::key_index(int64_t tokens_per_media) const {
  const int64_t T = tokens_per_media;
  return (slot_index().unsqueeze(1) * T + at::arange(T, at::kLong).unsqueeze(0)).reshape({-1});
}

LocalMedia encode_local_media(const attention::MediaMask& mm, const at::Tensor& pixel_values,
                              bool local, const Parallel& par, int64_t width,
                              const std::function<at::Tensor(const at::Tensor&)>& encode,
                              const at::TensorOptions& options, const std::string& model,
                              LocalMedia* media) {
  const int64_t B = mm.q_media.size(0), T = mm.tokens_per_media;
  LocalMedia out;
  out.slots = media_slots(mm.slots, par.rank(), par.world());
  const int64_t S = static_cast<int64_t>(out.slots.size());
  if (media && media->features.defined()) {
    LVX_CHECK(media->slots == out.slots && media->features.dim() == 3 &&
                  media->features.size(0) == B && media->features.size(1) == S * T &&
                  media->features.size(2) == width,
              model, ": precomputed media features of ", media->slots.size(), " slots ",
              media->features.sizes(), " do not fit rank ", par.rank(), "'s ", S, " slots of ",
              B, " x ", S * T, " x ", width);
    return *media;
  }
  const at::Tensor present = mm.media_starts >= 0;  // [B, slots]
  const at::Tensor counts = present.sum(1);         // images per sample
  const at::Tensor first = at::cumsum(counts, 0) - counts;  // each sample's first image
  std::vector<int64_t> images, rows;  // image index in pixel_values, row (b·S + i) it fills
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < S; ++i)
      if (present[b][out.slots[i]].item<bool>()) {
        images.push_back(local ? static_cast<int64_t>(images.size())
                               : first[b].item<int64_t>() + out.slots[i]);
        rows.push_back(b * S + i);
      }
  const int64_t expected = local ? static_cast<int64_t>(images.size()) : counts.sum().item<int64_t>();
  LVX_CHECK(pixel_values.defined() && pixel_values.dim() == 4 && pixel_values.size(0) == expected,
            model, ": input_ids hold ", expected, " media tokens",
            local ? str(" in rank ", par.rank(), "'s share") : std::string(),
            " but pixel_values has ",
            pixel_values.defined() ? str(pixel_values.sizes()) : std::string("none"));
  at::Tensor feats = at::zeros({B * S, T, width}, options);
  if (!images.empty()) {
    // Host-made indices, moved to the tensors they index.
    const at::Tensor image_index = at::tensor(images, at::kLong).to(pixel_values.device());
    const at::Tensor row_index = at::tensor(rows, at::kLong).to(feats.device());
    feats = feats.index_copy(0, row_index, encode(pixel_values.index_select(0, image_index)));
  }
  out.features = feats.view({B, S * T, width});
  if (media) *media = out;
  return out;
}

attention::MediaMask media_mask_on(const attention::MediaMask& mm, at::Device device) {
  attention::MediaMask out = mm;
  for (at::Tensor* t : {&out.q_media, &out.kv_media, &out.media_starts})
    if (t->defined()) *t = t->to(device);
  return out;
}

at::Tensor host_ids(const at::Tensor& input_ids) {
  return input_ids.device().is_cpu() ? input_ids : input_ids.cpu();
}

}  // namespace lvx::models
