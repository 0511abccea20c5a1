// Media masks from token ids: which images each text token may cross-attend to, per model.
//
// The attention kernels take a media mask as per-token media indices (kernels/attention.h,
// MaskKind::kMedia): q_media[b, t] for each text token and kv_media[b, j] for each visual key,
// plus a MediaRule (kImmediate: visible iff kv_media == q_media; kUpTo: visible iff
// kv_media <= q_media; −1 on either side: not visible). This file derives those indices from
// input_ids for each released model, so model code never writes the off-by-one itself.
//
// The model rules, with c_in(t) = number of media tokens at positions <= t (inclusive count) and
// c_ex(t) = number at positions < t (exclusive count), images numbered 0, 1, ... in token order:
//
//   OpenFlamingo (only_attend_immediate_media=True, every released checkpoint), helpers.py
//   MaskedCrossAttention.forward: `text_time = media_locations.cumsum(-1)`,
//   `media_time = arange(T_img) + 1`, mask `text_time == media_time`; rows with text_time == 0
//   get their attention zeroed.
//     → text token t sees only image c_in(t) − 1: the most recent image, and the `<image>`
//       token sees its OWN image. q_media = c_in − 1, kImmediate.
//
//   OpenFlamingo all-previous (only_attend_immediate_media=False): same code with `>=`.
//     → t sees images 0 .. c_in(t) − 1. q_media = c_in − 1, kUpTo.
//     One deliberate difference: rows before the first image (text_time == 0) have every logit
//     masked and the package does not zero them in this mode, so its softmax spreads uniformly
//     over ALL media keys (later images included). Here they see nothing (output 0), as in the
//     immediate mode.
//
//   mPLUG-Owl3 240728 (also 1B/2B-241014; the separate, gated cross-attention):
//     processor `count = (arange(L)[:, None] > media_starts[None]).sum(1)` (strict `>`), then
//     modeling_hyper_qwen2.py `make_t2v_mask`: `mask = offset_line <= arange(num_images)`
//     where True means MASKED (x_sdpa inverts it).
//     → t sees images j < c_ex(t): all images strictly BEFORE t; the `<|image|>` token does NOT
//       see its own image (only the tokens after it do). q_media = c_ex − 1, kUpTo.
//     Rows with q_media == −1 (no image before them) are skipped by the model: they keep pure
//     self-attention, with no gate mix. The kernel gives them o = 0, lse = −inf; model code
//     must apply the gate only where q_media >= 0. An image whose token is the sample's last
//     token is seen by nobody (the released code leaves it out of the keys, and raises when it
//     is the sample's only image; here its keys are present and invisible: same outputs).
//
//   mPLUG-Owl3 241101 (fused hyper attention, one softmax over [visual keys | text keys]):
//     modeling_hyper_qwen2.py `t2vmask = ~(arange(q_len)[:, None] < media_starts[None])`,
//     True = attend.
//     → t sees images j with media_starts[j] <= t: all previous images AND the `<|image|>` token
//       sees its own image. q_media = c_in − 1, kUpTo. This is the visual part of the fused
//       mask only; the text part is the usual causal mask.
//
// So on the media token's own row the three rules differ by one: OpenFlamingo and 241101 see
// the image the token introduces, 240728 does not; and after it OpenFlamingo sees only the most
// recent image while both mPLUG-Owl3 versions see all earlier ones.
//
// Every model puts one token id per image in input_ids (OpenFlamingo `<image>`, mPLUG-Owl3
// `<|image|>`); the visual tokens of all images of a sample are concatenated in image order as
// the keys (slots × tokens_per_media), images a sample does not have are padding keys.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/attention.h"

namespace lvx::attention {

enum class MediaMaskModel {
  kOpenFlamingo,             // "openflamingo": most recent image only, own image included
  kOpenFlamingoAllPrevious,  // "openflamingo-all-previous": only_attend_immediate_media=False
  kMplugOwl3_240728,         // "mplug-owl3-240728" (alias "mplug-owl3-241014"): images before t
  kMplugOwl3_241101,         // "mplug-owl3-241101": images from their `<|image|>` token on
};

// Canonical name of a model rule (the strings parse_media_mask_model accepts).
const char* media_mask_model_name(MediaMaskModel model);
// Every accepted name, canonical ones first, then aliases.
std::vector<std::string> media_mask_model_names();
// Name → rule; an unknown name is an lvx::Error listing every valid name.
MediaMaskModel parse_media_mask_model(const std::string& name);

struct MediaMask {
  at::Tensor q_media;   // int32 [B, L]: newest image index token t may see (kUpTo: it sees
                        // images 0..q_media; kImmediate: only q_media); −1: sees no image
  at::Tensor kv_media;  // int32 [B, slots * tokens_per_media]: j / tokens_per_media when
                        // sample b has that image, −1 for a slot it does not have (padding)
  kernels::MediaRule rule = kernels::MediaRule::kImmediate;  // how the kernels compare them
  // A token with q_media −1 sees every key instead of none (Llama-3.2-Vision's rows that see
  // no image; kernels::AttentionMask::unmatched_sees_all). The four rules below leave it false.
  bool unmatched_sees_all = false;
  at::Tensor media_starts;  // int64 [B, slots]: sequence index of each image's media token, −1
                            // for absent images. mPLUG-Owl3 MI-RoPE rotates image j's keys at
                            // media_starts[j] + 1 (240728/241014) or media_starts[j] (241101)
  int64_t slots = 0;        // images per sample in the key layout
  int64_t tokens_per_media = 0;

  // The kernel mask (MaskKind::kMedia) with these indices; kv_valid is left empty.
  kernels::AttentionMask attention_mask() const;
};

// All four take input_ids int64 [B, L] (any device; results on the same device), the token id
// that stands for one image, the number of visual tokens per image (>= 1) and, optionally, the
// number of image slots in the key layout (>= the largest image count of any sample; default
// exactly that largest count, 0 when no sample has an image). Samples may have any number of
// images, none included.
MediaMask openflamingo_media_mask(const at::Tensor& input_ids, int64_t media_token_id,
                                  int64_t tokens_per_media,
                                  std::optional<int64_t> slots = std::nullopt);
MediaMask openflamingo_all_previous_media_mask(const at::Tensor& input_ids, int64_t media_token_id,
                                               int64_t tokens_per_media,
                                               std::optional<int64_t> slots = std::nullopt);
MediaMask mplug_owl3_240728_media_mask(const at::Tensor& input_ids, int64_t media_token_id,
                                       int64_t tokens_per_media,
                                       std::optional<int64_t> slots = std::nullopt);
MediaMask mplug_owl3_241101_media_mask(const at::Tensor& input_ids, int64_t media_token_id,
                                       int64_t tokens_per_media,
                                       std::optional<int64_t> slots = std::nullopt);

// The function of `model`.
MediaMask media_mask(MediaMaskModel model, const at::Tensor& input_ids, int64_t media_token_id,
                     int64_t tokens_per_media, std::optional<int64_t> slots = std::nullopt);

}  // namespace lvx::attention
