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
//
// Tiles across ranks (encode_tiles with a group): every token but attention's is computed per
// token or per tile, so rank r takes tiles [first, first + count) of every image (tile_share) and
// runs the whole tower on them; each encoder layer all-gathers its keys and values (sequence
// parallelism for one image, as Ulysses' and ring attention's all-gather baseline: the queries
// stay, every tile's keys come), and the outputs are exact per token: one 4-tile image on two
// ranks is two tiles' work each instead of four on one rank and none on the other.
#pragma once

#include <ATen/ATen.h>

#include "models/checkpoint.h"
#include "models/mllama/config.h"

namespace lvx::dist {
class ProcessGroup;
}

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

// The tiles [first, first + count) of every image that rank `rank` of `world` encodes when the
// tiles are shared: ceil(tiles / world) each in rank order (ranks past the last tile: none).
struct TileShare {
  int64_t first = 0, count = 0;
};
TileShare tile_share(int64_t tiles, int rank, int world);

// The vision model's output before multi_modal_projector, [n, count · tokens_per_tile,
// vision_output_dim], for this rank's tiles (tile_share) of every image; with `pg` null, every
// tile (count = max_num_tiles). Every rank of `pg` passes all n images and calls it together
// (each encoder layer all-gathers keys and values). The tower must be frozen then: the gathers
// carry no gradient (an error otherwise).
at::Tensor encode_tiles(const StateDict& w, const Config& c, const at::Tensor& pixel_values,
                        const at::Tensor& aspect_ratio_ids, const at::Tensor& aspect_ratio_mask,
                        dist::ProcessGroup* pg);
// multi_modal_projector: [..., vision_output_dim] → [..., text.hidden].
at::Tensor project(const StateDict& w, const at::Tensor& vision_output);

}  // namespace lvx::models::mllama
