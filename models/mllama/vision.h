// Llama-3.2-Vision's tiled image encoder (transformers' MllamaVisionModel) and its
// multi_modal_projector, in ATen with autograd (fine-tuning may train the projector). Per image
// (all its tiles together, images independent of each other), as MllamaVisionModel.forward:
//   patch conv (no bias) → + pre-tile embedding (tanh(gate)·table[aspect_ratio_id], per tile) →
//   class token first in every tile → gated positional embedding ((1 − tanh g)·shared table +
//   tanh g·tile table of the aspect ratio) → layernorm_pre (eps 1e-5) → pad each tile's tokens
//   to a multiple of 8 → local transformer (keeping the outputs of intermediate_layers_indices)
//   → layernorm_post → + post-tile embedding → global transformer (tanh-gated layers) →
//   [final | intermediates stacked on a last axis and flattened] → strip the padding →
//   multi_modal_projector Linear.
// The encoders' attention mask is transformers' as is: a (query, key) pair is masked only when
// BOTH are padding (a padding tile per aspect_ratio_mask, or a pad-to-8 token); real tokens see
// padding tiles.
#pragma once

#include <ATen/ATen.h>

#include "models/checkpoint.h"
#include "models/mllama/config.h"

namespace lvx::models::mllama {

// Images → the projected visual tokens the cross layers read: pixel_values [n, tiles, 3, H, W]
// (tiles == max_num_tiles, H == W == image_size, already normalised), aspect_ratio_ids int64
// [n] (1-based index into supported_aspect_ratios; 0 only for padding images), aspect_ratio_mask
// int64 [n, tiles] (1: a real tile) → [n, tiles * tokens_per_tile, text.hidden] (after
// multi_modal_projector), dtype/device of the weights. Weights under the on-disk names
// (vision_model.*, multi_modal_projector.*).
at::Tensor encode_images(const StateDict& w, const Config& c, const at::Tensor& pixel_values,
                         const at::Tensor& aspect_ratio_ids, const at::Tensor& aspect_ratio_mask);

// Video frames (lvx qa / finetune: [F, 3, S, S], S = image_size) as single-tile images, as
// MllamaImageProcessor would tile a frame already resized to one tile: tile 0 the frame, the
// others zero, aspect ratio id of (1, 1), mask [1, 0, ...]. Options of `frames`. lvx's "clip"
// preprocessing preset (CLIP mean/std, as MllamaImageProcessor normalises) resizes the short
// side and crops the centre to image_size; MllamaImageProcessor instead resizes the whole frame
// into its best tile canvas keeping the aspect ratio and pads the rest with zeros (a wide frame
// becomes several tiles). So a frame here is one tile of the centre crop, not the processor's
// tiling of the full frame.
struct Tiled {
  at::Tensor pixel_values;       // [F, max_num_tiles, 3, S, S]
  at::Tensor aspect_ratio_ids;   // int64 [F]
  at::Tensor aspect_ratio_mask;  // int64 [F, max_num_tiles]
};
Tiled frames_as_images(const Config& c, const at::Tensor& frames);

}  // namespace lvx::models::mllama
