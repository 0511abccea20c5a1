// Llama-3.2-Vision's cross-attention mask (transformers' MllamaProcessor and
// _prepare_cross_attention_mask) as lvx's kernel media masks.
//
// The processor gives cross_attention_mask [B, L, images, tiles]: 1 where text token t may see
// tile k of image j. The model turns it into an additive bias over the keys (image j, tile k:
// tokens_per_tile keys each), and a row that sees NO tile gets bias 0 on every key instead (it
// attends to all of them, padding images and tiles included) while its MLP branch is zeroed
// (full_text_row_masked_out_mask).
//
// The kernels compare one integer per query with one per key (kernels/attention.h). The
// processor's rule (image j from its <|image|> token to the next non-consecutive <|image|>)
// makes rows see NESTED sets inside a run of consecutive images (the first <|image|> of the run
// sees its own image, the next sees two, ...) and disjoint sets across runs, so one comparison
// cannot express it. lvx splits it into cross-attention calls, one per "family" of nested sets:
//   - the distinct non-empty row sets of a sample fall into families (sets sharing a tile), each
//     a chain C_0 ⊂ C_1 ⊂ ... (otherwise an error naming the rows);
//   - call f takes family f of every sample under MediaRule::kUpTo: a tile of C_k \ C_(k−1) has
//     media index k, a row of C_k has q_media k; every other row and key −1;
//   - call 0 also carries the rows that see nothing, with unmatched_sees_all (they see every key;
//     its own values are shifted by one and the rows of other families get q_media 0, seeing
//     nothing there).
// Every row has keys in exactly one call and o = 0 (lse −inf) in the others, so the attention
// output is the SUM of the calls' outputs. A prompt whose images are one run (lvx qa, fine-tuning
// on frames) is one call.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "src/attention/media_mask.h"

namespace lvx::models::mllama {

struct CrossMask {
  // One media mask per call (kUpTo; slots = images, tokens_per_media = tiles · tokens_per_tile;
  // media_starts undefined); empty when the batch has no image (the cross layers are skipped).
  std::vector<attention::MediaMask> calls;
  at::Tensor sees_media;  // bool [B, L]: full_text_row_masked_out_mask (the row sees some tile)
  // bool [B, images · tiles · tokens_per_tile]: the keys the LAST token sees (every key when it
  // sees no tile); generated tokens repeat the last row of the mask, as transformers' generate.
  at::Tensor last_row_keys;
  at::Tensor last_row_sees_media;  // bool [B]
};

// From cross_attention_mask (integer [B, L, images, tiles], 0/1, on the host) with
// tokens_per_tile keys per tile. Errors name `where` and the field.
CrossMask cross_mask(const at::Tensor& cross_attention_mask, int64_t tokens_per_tile,
                     const std::string& where);

// The processor's cross_attention_mask from input_ids (int64 [B, L], host) when the batch gives
// none (get_cross_attention_token_mask + convert_sparse_cross_attention_mask_to_dense): image j
// of sample b (its j-th <|image|> token) is seen from its token to the next non-consecutive
// <|image|> (a run of consecutive ones all reach the run's end), the last to the end, on its
// num_tiles[b, j] real tiles. num_tiles int64 [B, images]; a sample's <|image|> count must not
// exceed `images` and every image it has must have >= 1 tile. int64 [B, L, images, max_tiles].
at::Tensor cross_attention_mask_from_ids(const at::Tensor& input_ids, int64_t image_token_id,
                                         const at::Tensor& num_tiles, int64_t max_tiles,
                                         const std::string& where);

}  // namespace lvx::models::mllama
