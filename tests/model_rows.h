// Model::decode_rows against decode_step, for every family (models/model.h): generations at
// different lengths, each prefilled alone, stepped together, must give each row's own
// decode_step logits (up to the batched products' rounding), leave each cache at its own length,
// and, for one row, be decode_step bit for bit. What lvx serve's continuous batching relies on
// (src/runtime/generate.h step_together).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "models/decode.h"
#include "models/model.h"
#include "src/dist/process_group.h"

namespace lvx::testing {

struct RowsDiff {
  double worst = 0;            // max |decode_rows − each row's decode_step| over 4 steps
  bool lengths_equal = false;  // every row's cache ends at its own length
  bool one_row_bitwise = false;
  bool fronted = false;  // the rows' prompt keys joined their own keys' product (prompt_front)
};

// Rows: `row0` [1, L] with its images `pixels` as it is, then with 2 and 5 more tokens; and, when
// `text_only` [1, L'] is given, a row without images (a cross layer skips it). One rank.
// one_length: instead three prompts of one length (row0 with 2 more tokens, three different
// pairs), whose prompt keys then join each row's own keys' product (models/decode.h
// prompt_front) instead of a call over them and a merge.
inline RowsDiff decode_rows_against_steps(const models::Model& model, const at::Tensor& row0,
                                          const at::Tensor& pixels,
                                          const at::Tensor& text_only = {},
                                          bool one_length = false) {
  models::Parallel par;
  par.pg = std::make_shared<dist::ProcessGroup>(dist::RendezvousInfo{});
  std::vector<models::ModelInputs> prompts;
  const std::vector<std::vector<int64_t>> extras =
      one_length ? std::vector<std::vector<int64_t>>{{5, 6}, {7, 8}, {9, 10}}
                 : std::vector<std::vector<int64_t>>{{}, {5, 6}, {5, 6, 7, 8, 9}};
  for (const std::vector<int64_t>& extra : extras)
    prompts.push_back({at::cat({row0, at::tensor(extra, at::kLong).view({1, -1})}, 1).contiguous(),
                       pixels,
                       false,
                       {}});
  if (text_only.defined()) prompts.push_back({text_only, at::Tensor(), false, {}});
  const size_t R = prompts.size();
  std::vector<models::DecodeCache> alone(R), together(R);
  std::vector<models::DecodeCache*> rows;
  for (size_t r = 0; r < R; ++r) {
    model.prefill(prompts[r], par, alone[r]);
    model.prefill(prompts[r], par, together[r]);
    rows.push_back(&together[r]);
  }
  RowsDiff d;
  for (int64_t step = 0; step < 4; ++step) {
    const at::Tensor tokens = at::arange(11 + step, 11 + step + static_cast<int64_t>(R), at::kLong);
    const at::Tensor joint = model.decode_rows(tokens, par, rows);
    for (size_t r = 0; r < R; ++r) {
      const auto i = static_cast<int64_t>(r);
      const at::Tensor own = model.decode_step(tokens.narrow(0, i, 1).contiguous(), par, alone[r]);
      d.worst = std::max(d.worst, (joint.narrow(0, i, 1) - own).abs().max().item<double>());
    }
  }
  for (size_t l = 0; l < rows.front()->prompt.size(); ++l)
    d.fronted = d.fronted || static_cast<bool>(models::prompt_front(rows, l, par));
  d.lengths_equal = true;
  for (size_t r = 0; r < R; ++r)
    d.lengths_equal = d.lengths_equal && together[r].length == alone[r].length;
  models::DecodeCache a, b;
  model.prefill(prompts[0], par, a);
  model.prefill(prompts[0], par, b);
  const at::Tensor t = at::tensor({21}, at::kLong);
  d.one_row_bitwise = at::equal(model.decode_rows(t, par, {&a}), model.decode_step(t, par, b));
  return d;
}

}  // namespace lvx::testing
