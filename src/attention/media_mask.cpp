// Media masks from token ids; the rules' meaning is in media_mask.h.
#include "src/attention/media_mask.h"

#include <utility>

#include "src/common/error.h"

namespace lvx::attention {

kernels::MediaRule MediaMaskRule::kernel_rule() const {
  return sees == MediaSees::kMostRecent ? kernels::MediaRule::kImmediate
                                        : kernels::MediaRule::kUpTo;
}

std::string media_mask_rule_name(const MediaMaskRule& rule) {
  return std::string(rule.sees == MediaSees::kMostRecent ? "most-recent" : "up-to-most-recent") +
         (rule.own_token_included ? "" : "-after-token");
}

std::vector<MediaMaskRule> media_mask_rules() {
  return {{MediaSees::kMostRecent, true},
          {MediaSees::kMostRecent, false},
          {MediaSees::kUpToMostRecent, true},
          {MediaSees::kUpToMostRecent, false}};
}

std::optional<MediaMaskRule> media_mask_rule_by_meaning(const std::string& name) {
  for (const MediaMaskRule& r : media_mask_rules())
    if (media_mask_rule_name(r) == name) return r;
  return std::nullopt;
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

MediaMask media_mask(const MediaMaskRule& rule, const at::Tensor& input_ids, int64_t media_token_id,
                     int64_t tokens_per_media, std::optional<int64_t> slots) {
  const char* fn = "media_mask";
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
  m.rule = rule.kernel_rule();
  m.slots = n_slots;
  m.tokens_per_media = tokens_per_media;
  // q_media = count − 1: the inclusive count c_in, or the exclusive one (media tokens at < t).
  const auto c = rule.own_token_included ? c_in : c_in - is_media.to(at::kLong);
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

}  // namespace lvx::attention
