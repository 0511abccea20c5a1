// Media masks from token ids: which images each text token may cross-attend to, under a rule
// stated by its meaning.
//
// The attention kernels take a media mask as per-token media indices (kernels/attention.h,
// MaskKind::kMedia): q_media[b, t] for each text token and kv_media[b, j] for each visual key,
// plus a MediaRule (kImmediate: visible iff kv_media == q_media; kUpTo: visible iff
// kv_media <= q_media; −1 on either side: not visible). This file derives those indices from
// input_ids, so model code never writes the off-by-one itself.
//
// Every model puts one token id per image in input_ids (its media token); images are numbered
// 0, 1, ... in token order, and the visual tokens of all images of a sample are concatenated in
// image order as the keys (slots × tokens_per_media), images a sample does not have are padding
// keys. A rule answers two questions (MediaMaskRule):
//   - which images a token sees: only the most recent one (kernels kImmediate) or every one up
//     to the most recent (kUpTo);
//   - whether a media token's own image is already "the most recent" on its own row:
//     q_media = c_in(t) − 1 with c_in(t) = the number of media tokens at positions <= t
//     (included), or q_media = c_ex(t) − 1 with c_ex(t) = the number at positions < t (not
//     included: the image is seen from the token after its media token on).
// Tokens before any image (q_media == −1) see nothing. Each model family states which rule its
// released code implements, with the derivation from that code, in its folder under models/.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/attention.h"

namespace lvx::attention {

// Which images a text token sees, counted from the most recent image it has (MediaMaskRule).
enum class MediaSees {
  kMostRecent,      // only the most recent image: kv_media == q_media (kernels kImmediate)
  kUpToMostRecent,  // every image up to the most recent: kv_media <= q_media (kernels kUpTo)
};

struct MediaMaskRule {
  MediaSees sees = MediaSees::kMostRecent;
  // true: a media token sees its own image (q_media counts media tokens at positions <= t);
  // false: only the tokens after it do (positions < t).
  bool own_token_included = true;

  bool operator==(const MediaMaskRule& o) const {
    return sees == o.sees && own_token_included == o.own_token_included;
  }
  bool operator!=(const MediaMaskRule& o) const { return !(*this == o); }
  // The kernels' comparison of this rule.
  kernels::MediaRule kernel_rule() const;
};

// The rule's name by meaning ("most-recent", "most-recent-after-token", "up-to-most-recent",
// "up-to-most-recent-after-token": "-after-token" when a media token does not see its own image).
std::string media_mask_rule_name(const MediaMaskRule& rule);
// Every rule by meaning, in the order of the names above.
std::vector<MediaMaskRule> media_mask_rules();
// A name by meaning → the rule; nullopt for any other name (callers add their own names and
// the error: models/family.h, models::media_mask_rule).
std::optional<MediaMaskRule> media_mask_rule_by_meaning(const std::string& name);

struct MediaMask {
  at::Tensor q_media;   // int32 [B, L]: newest image index token t may see (kUpTo: it sees
                        // images 0..q_media; kImmediate: only q_media); −1: sees no image
  at::Tensor kv_media;  // int32 [B, slots * tokens_per_media]: j / tokens_per_media when
                        // sample b has that image, −1 for a slot it does not have (padding)
  kernels::MediaRule rule = kernels::MediaRule::kImmediate;  // how the kernels compare them
  // A token with q_media −1 sees every key instead of none (Llama-3.2-Vision's rows that see
  // no image; kernels::AttentionMask::unmatched_sees_all). media_mask() leaves it false.
  bool unmatched_sees_all = false;
  at::Tensor media_starts;  // int64 [B, slots]: sequence index of each image's media token, −1
                            // for absent images (a family's rotary positions of image keys
                            // start from it)
  int64_t slots = 0;        // images per sample in the key layout
  int64_t tokens_per_media = 0;

  // The kernel mask (MaskKind::kMedia) with these indices; kv_valid is left empty.
  kernels::AttentionMask attention_mask() const;
};

// The mask of `rule` for input_ids int64 [B, L] (any device; results on the same device), the
// token id that stands for one image, the number of visual tokens per image (>= 1) and,
// optionally, the number of image slots in the key layout (>= the largest image count of any
// sample; default exactly that largest count, 0 when no sample has an image). Samples may have
// any number of images, none included. Errors name media_mask and the argument.
MediaMask media_mask(const MediaMaskRule& rule, const at::Tensor& input_ids, int64_t media_token_id,
                     int64_t tokens_per_media, std::optional<int64_t> slots = std::nullopt);

}  // namespace lvx::attention
