// Model::extend against the whole prefill, for every family (models/model.h): a prefill of the
// prompt up to its last image token, then the rest in one extend, must give the last token's
// logits of a prefill of the whole prompt and of the rest fed token by token through decode
// steps, and leave a cache that continues as the whole prefill's (the next decode step agrees).
// What lvx serve's kept prompt prefixes rely on (src/runtime/generate.h).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "models/model.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"

namespace lvx::testing {

struct ExtendDiff {
  int64_t split = 0, length = 0;      // prefix tokens, prompt tokens
  double whole = 0, steps = 0, next = 0;  // max |Δ logits| against each
};

// `ids` [B, L] has an image token before its last position, `pixels` its images; the family's
// other inputs are derived from the ids (as in lvx qa and lvx serve). On `pg`'s ranks with the
// default strategies (every rank calls it alike), or on one rank.
inline ExtendDiff extend_against_prefill(const models::Model& model, const at::Tensor& ids,
                                         const at::Tensor& pixels,
                                         std::shared_ptr<dist::ProcessGroup> pg = nullptr) {
  models::Parallel par;
  par.pg = pg ? pg : std::make_shared<dist::ProcessGroup>(dist::RendezvousInfo{});
  ExtendDiff d;
  d.length = ids.size(1);
  const at::Tensor media = ids.eq(model.media_token_id()).any(0);
  for (int64_t t = 0; t < ids.size(1); ++t)
    if (media[t].item<bool>()) d.split = t + 1;
  EXPECT_GT(d.split, 0);
  EXPECT_LT(d.split, ids.size(1));
  if (d.split == 0 || d.split >= ids.size(1)) return d;
  const at::Tensor prefix = ids.narrow(1, 0, d.split);
  auto inputs = [&](const at::Tensor& x) { return models::ModelInputs{x, pixels, false, {}}; };
  models::DecodeCache whole_c, ext_c, step_c;
  const at::Tensor whole = model.prefill(inputs(ids), par, whole_c);
  model.prefill(inputs(prefix), par, ext_c);
  const at::Tensor ext = model.extend(ids.narrow(1, d.split, ids.size(1) - d.split), par, ext_c);
  model.prefill(inputs(prefix), par, step_c);
  at::Tensor step;
  for (int64_t t = d.split; t < ids.size(1); ++t)
    step = model.decode_step(ids.select(1, t).contiguous(), par, step_c);
  d.whole = (ext - whole).abs().max().item<double>();
  d.steps = (ext - step).abs().max().item<double>();
  const at::Tensor next = at::full({ids.size(0)}, 9, at::kLong);
  d.next = (model.decode_step(next, par, ext_c) - model.decode_step(next, par, whole_c))
               .abs()
               .max()
               .item<double>();
  return d;
}

// Chunked prefill (Model::prefill_media, then extend per chunk of `chunk` tokens, then
// seal_chunked_prompt: lvx serve's --max-batch-tokens) of the prefix of `ids` (up to its last
// image token) against its whole prefill: the rest of the prompt extended after either must give
// the same logits, and the next decode step too. Returns the largest |Δ logits| of the two.
inline double chunked_against_prefill(const models::Model& model, const at::Tensor& ids,
                                      const at::Tensor& pixels, int64_t chunk,
                                      std::shared_ptr<dist::ProcessGroup> pg = nullptr) {
  models::Parallel par;
  par.pg = pg ? pg : std::make_shared<dist::ProcessGroup>(dist::RendezvousInfo{});
  int64_t split = 0;
  const at::Tensor media = ids.eq(model.media_token_id()).any(0);
  for (int64_t t = 0; t < ids.size(1); ++t)
    if (media[t].item<bool>()) split = t + 1;
  EXPECT_GT(split, chunk);  // more than one chunk
  const at::Tensor prefix = ids.narrow(1, 0, split), tail = ids.narrow(1, split, ids.size(1) - split);
  models::DecodeCache whole, chunked;
  model.prefill({prefix, pixels, false, {}}, par, whole);
  const at::Tensor want = model.extend(tail, par, whole);
  model.prefill_media({prefix, pixels, false, {}}, par, chunked);
  for (int64_t at = 0; at < split; at += chunk)
    model.extend(prefix.narrow(1, at, std::min(chunk, split - at)).contiguous(), par, chunked);
  models::seal_chunked_prompt(chunked, par.pg->rank(), par.pg->world_size());
  EXPECT_EQ(chunked.length, split);
  const at::Tensor got = model.extend(tail, par, chunked);
  EXPECT_EQ(chunked.length, whole.length);
  const at::Tensor next = at::full({ids.size(0)}, 9, at::kLong);
  const double step = (model.decode_step(next, par, chunked) - model.decode_step(next, par, whole))
                          .abs()
                          .max()
                          .item<double>();
  return std::max((got - want).abs().max().item<double>(), step);
}

// A reference batch's input_ids with 3 text tokens appended, so that every row ends in text (a
// prefix up to its last image, then a question).
inline at::Tensor with_text_tail(const at::Tensor& ids) {
  return at::cat({ids, at::tensor({5, 6, 7}, at::kLong).expand({ids.size(0), 3})}, 1);
}

// chunked_against_prefill of a reference checkpoint's batch (its ids with_text_tail) for each
// chunk size: the largest |Δ logits|.
inline double worst_chunked(const std::string& model_dir, const std::string& batch_file,
                            const std::vector<int64_t>& chunks,
                            std::shared_ptr<dist::ProcessGroup> pg = nullptr) {
  const auto batch = load_safetensors(batch_file).tensors;
  const auto model = models::load_model(model_dir, at::kFloat);
  EXPECT_TRUE(model->can_prefill_in_chunks());
  double worst = 0;
  for (int64_t chunk : chunks)
    worst = std::max(worst, chunked_against_prefill(*model, with_text_tail(batch.at("input_ids")),
                                                    batch.at("pixel_values"), chunk, pg));
  return worst;
}

}  // namespace lvx::testing
