// Llama-3.2-Vision's tiled image encoder (transformers' MllamaVisionModel) and its
// multi_modal_projector, in ATen with autograd (fine-tuning may train the projector). Per image
// (all its tiles together, images independent of each other):
//   patch conv (no bias) → + class token per tile → gated positional embedding (tanh(gate)·tile
//   table of the aspect ratio + (1 − tanh(gate))·shared table) → pre-tile positional embedding →
//   layernorm_pre → pad patches to a multiple of 8 → local transformer (padding tiles and
//   padding patches masked as keys; the hidden states of intermediate_layers_indices kept) →
//   layernorm_post → post-tile positional embedding → global transformer (gated layers) →
//   [final | intermediates] → strip the padding → multi_modal_projector Linear.
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
// others zero, aspect ratio id of (1, 1), mask [1, 0, ...]. Options of `frames`.
struct Tiled {
  at::Tensor pixel_values;       // [F, max_num_tiles, 3, S, S]
  at::Tensor aspect_ratio_ids;   // int64 [F]
  at::Tensor aspect_ratio_mask;  // int64 [F, max_num_tiles]
};
Tiled frames_as_images(const Config& c, const at::Tensor& frames);

}  // namespace lvx::models::mllama
