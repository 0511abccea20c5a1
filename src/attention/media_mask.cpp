// Media masks from token ids; the rules and their sources are in media_mask.h.
#include "src/attention/media_mask.h"

#include <utility>

#include "src/common/error.h"

namespace lvx::attention {

namespace {

struct NamedModel {
  const char* name;
  MediaMaskModel model;
};

// Canonical names first (media_mask_model_name returns these), then aliases.
constexpr NamedModel kNames[] = {
    {"openflamingo", MediaMaskModel::kOpenFlamingo},
    {"openflamingo-all-previous", MediaMaskModel::kOpenFlamingoAllPrevious},
    {"mplug-owl3-240728", MediaMaskModel::kMplugOwl3_240728},
    {"mplug-owl3-241101", MediaMaskModel::kMplugOwl3_241101},
    {"mplug-owl3-241014", MediaMaskModel::kMplugOwl3_240728},
};

// Which count a rule uses for q_media = count − 1.
enum class Count {
  kInclusive,  // media tokens at positions <= t: the media token sees its own image
  kExclusive,  // media tokens at positions < t: it does not
};

MediaMask build(const char* fn, const at::Tensor& input_ids, int64_t media_token_id,
                int64_t tokens_per_media, std::optional<int64_t> slots, Count count,
                kernels::MediaRule rule) {
  LVX_CHECK(input_ids.defined(), fn, ": input_ids: expected an int64 tensor [B, L], got none");
  LVX_CHECK(input_ids.scalar_type() == at::kLong, fn,
            ": input_ids: expected dtype int64 (Long), got ", input_ids.scalar_type());
  LVX_CHECK(input_ids.dim() == 2, fn, ": input_ids: expected rank 2 [B, L], got rank ",
            input_ids.dim(), " ", input_ids.sizes());
  LVX_CHECK(media_token_id >= 0, fn, ": media_token_id: expected a token id >= 0, got ",
            media_token_id);
  LVX_CHECK(tokens_per_media >= 1, fn, ": tokens_per_media: expected >= 1, got ", tokens_per_media);
  if (slots) LVX_CHECK(*slots >= 0, fn, ": slots: expected >= 0, got ", *slots);

  const int64_t batch = input_ids.size(0), len = input_ids.size(1);
  const auto opts = input_ids.options().dtype(at::kLong);
  const auto is_media = input_ids.eq(media_token_id);       // bool [B, L]
  const auto c_in = is_media.cumsum(1, at::kLong);          // media tokens at <= t
  const auto images = is_media.sum({1}, false, at::kLong);  // [B]
  int64_t most = 0, most_at = 0;
  if (batch > 0) {
    most_at = images.argmax().item<int64_t>();
    most = images[most_at].item<int64_t>();
  }
  const int64_t n_slots = slots.value_or(most);
  LVX_CHECK(most <= n_slots, fn, ": slots: expected at least the image count of every sample, got ",
            n_slots, " slots but sample ", most_at, " of input_ids has ", most,
            " media tokens (id ", media_token_id, ")");

  MediaMask m;
  m.rule = rule;
  m.slots = n_slots;
  m.tokens_per_media = tokens_per_media;
  const auto c = count == Count::kInclusive ? c_in : c_in - is_media.to(at::kLong);
  m.q_media = (c - 1).to(at::kInt);

  // Image i of sample b sits at the position where c_in first reaches i + 1; every other
  // position writes into a spare last column that is dropped.
  auto starts = at::full({batch, n_slots + 1}, -1, opts);
  const auto column = at::where(is_media, c_in - 1, at::full({}, n_slots, opts));
  starts.scatter_(1, column, at::arange(len, opts).unsqueeze(0).expand({batch, len}));
  m.media_starts = starts.narrow(1, 0, n_slots).contiguous();

  const auto slot_of_key = at::arange(n_slots, opts).repeat_interleave(tokens_per_media);
  m.kv_media = at::where(slot_of_key.unsqueeze(0) < images.unsqueeze(1), slot_of_key.unsqueeze(0),
                         at::full({}, -1, opts))
                   .to(at::kInt)
                   .contiguous();
  return m;
}

}  // namespace

const char* media_mask_model_name(MediaMaskModel model) {
  for (const auto& n : kNames)
    if (n.model == model) return n.name;
  LVX_FAIL("media_mask_model_name: model: expected a MediaMaskModel, got ",
           static_cast<int>(model));
}

std::vector<std::string> media_mask_model_names() {
  std::vector<std::string> out;
  for (const auto& n : kNames) out.emplace_back(n.name);
  return out;
}

MediaMaskModel parse_media_mask_model(const std::string& name) {
  std::string valid;
  for (const auto& n : kNames) {
    if (name == n.name) return n.model;
    valid += valid.empty() ? n.name : std::string(", ") + n.name;
  }
  LVX_FAIL("media mask model: expected one of ", valid, "; got '", name, "'");
}

kernels::AttentionMask MediaMask::attention_mask() const {
  kernels::AttentionMask a;
  a.kind = kernels::MaskKind::kMedia;
  a.media_rule = rule;
  a.unmatched_sees_all = unmatched_sees_all;
  a.q_media = q_media;
  a.kv_media = kv_media;
  return a;
}

// One line per model: which count, which comparison (the derivations are in media_mask.h).
MediaMask openflamingo_media_mask(const at::Tensor& input_ids, int64_t media_token_id,
                                  int64_t tokens_per_media, std::optional<int64_t> slots) {
  return build("openflamingo_media_mask", input_ids, media_token_id, tokens_per_media, slots,
               Count::kInclusive, kernels::MediaRule::kImmediate);
}

MediaMask openflamingo_all_previous_media_mask(const at::Tensor& input_ids, int64_t media_token_id,
                                               int64_t tokens_per_media,
                                               std::optional<int64_t> slots) {
  return build("openflamingo_all_previous_media_mask", input_ids, media_token_id, tokens_per_media,
               slots, Count::kInclusive, kernels::MediaRule::kUpTo);
}

MediaMask mplug_owl3_240728_media_mask(const at::Tensor& input_ids, int64_t media_token_id,
                                       int64_t tokens_per_media, std::optional<int64_t> slots) {
  return build("mplug_owl3_240728_media_mask", input_ids, media_token_id, tokens_per_media, slots,
               Count::kExclusive, kernels::MediaRule::kUpTo);
}

MediaMask mplug_owl3_241101_media_mask(const at::Tensor& input_ids, int64_t media_token_id,
                                       int64_t tokens_per_media, std::optional<int64_t> slots) {
  return build("mplug_owl3_241101_media_mask", input_ids, media_token_id, tokens_per_media, slots,
               Count::kInclusive, kernels::MediaRule::kUpTo);
}

MediaMask media_mask(MediaMaskModel model, const at::Tensor& input_ids, int64_t media_token_id,
                     int64_t tokens_per_media, std::optional<int64_t> slots) {
  switch (model) {
    case MediaMaskModel::kOpenFlamingo:
      return openflamingo_media_mask(input_ids, media_token_id, tokens_per_media, slots);
    case MediaMaskModel::kOpenFlamingoAllPrevious:
      return openflamingo_all_previous_media_mask(input_ids, media_token_id, tokens_per_media,
                                                  slots);
    case MediaMaskModel::kMplugOwl3_240728:
      return mplug_owl3_240728_media_mask(input_ids, media_token_id, tokens_per_media, slots);
    case MediaMaskModel::kMplugOwl3_241101:
      return mplug_owl3_241101_media_mask(input_ids, media_token_id, tokens_per_media, slots);
  }
  LVX_FAIL("media_mask: model: expected a MediaMaskModel, got ", static_cast<int>(model));
}

}  // namespace lvx::attention
