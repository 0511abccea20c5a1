// The rows' generated keys in one pool (models/row_key_pool.h, models/decode.h push_rows_keys):
// what a row reads back is exactly what it wrote, in order, through the pool's growth, a copy of
// its cache, and a row leaving to step alone and joining again. The reference is each row's
// tokens concatenated on their own (at::cat); every comparison is exact (the pool only copies).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "models/decode.h"
#include "models/parallel.h"
#include "models/row_key_pool.h"
#include "src/dist/process_group.h"

namespace {

using lvx::models::DecodeCache;
using lvx::models::RowKeyPool;
using lvx::models::RowSlot;

constexpr int64_t kHeads = 2, kDim = 3;

// The keys of `slots` at positions [0, length), [R, Hkv, L, D] each: what a device that reads
// the slots padded sees (kernels::slot_attention_composite's gather).
std::pair<at::Tensor, at::Tensor> gather(const RowKeyPool& pool, size_t layer,
                                         const at::Tensor& slots, int64_t length) {
  const auto [k, v] = pool.layer_keys(layer);
  return {k.narrow(2, 0, length).index_select(0, slots),
          v.narrow(2, 0, length).index_select(0, slots)};
}

at::Tensor tokens(int64_t n, double seed) {  // [n, Hkv, D], distinct values
  return at::arange(n * kHeads * kDim, at::kFloat).view({n, kHeads, kDim}) + seed;
}

// Rows written one at a time and together, with different counts, across the pool's growth in
// both positions and slots: each slot's keys, and the padded gather, are the row's own tokens.
TEST(RowKeyPool, RowsWrittenTogetherReadBackAsEachRowsOwn) {
  auto pool = std::make_shared<RowKeyPool>(2);
  std::vector<int64_t> slots{pool->acquire(), pool->acquire()};
  std::vector<at::Tensor> want_k(3), want_v(3);
  auto add = [&](size_t row, const at::Tensor& k, const at::Tensor& v) {
    want_k[row] = want_k[row].defined() ? at::cat({want_k[row], k}) : k;
    want_v[row] = want_v[row].defined() ? at::cat({want_v[row], v}) : v;
  };
  pool->append(1, slots[0], tokens(3, 0), tokens(3, 0.5));
  add(0, tokens(3, 0), tokens(3, 0.5));
  slots.push_back(pool->acquire());  // a third row joins: the pool grows in slots
  for (int step = 0; step < 6; ++step) {
    const std::vector<int64_t> counts{1, step == 2 ? 4 : 1, 2};
    const int64_t n = counts[0] + counts[1] + counts[2];
    const at::Tensor k = tokens(n, 100.0 * (step + 1)), v = tokens(n, -100.0 * (step + 1));
    pool->append_rows(1, slots, counts, k, v);
    int64_t first = 0;
    for (size_t r = 0; r < 3; ++r) {
      add(r, k.narrow(0, first, counts[r]), v.narrow(0, first, counts[r]));
      first += counts[r];
    }
  }
  int64_t longest = 0;
  for (size_t r = 0; r < 3; ++r) {
    ASSERT_EQ(pool->used(1, slots[r]), want_k[r].size(0)) << r;
    EXPECT_EQ(pool->used(0, slots[r]), 0) << "layer 0 was never written";
    const auto [k, v] = pool->slot_keys(1, slots[r]);
    EXPECT_TRUE(at::equal(k, want_k[r].unsqueeze(0))) << r;
    EXPECT_TRUE(at::equal(v, want_v[r].unsqueeze(0))) << r;
    longest = std::max(longest, want_k[r].size(0));
  }
  // The gather in another order: [R, Hkv, L, D], each row's own keys first.
  const std::vector<int64_t> order{slots[2], slots[0], slots[1]};
  const auto [gk, gv] = gather(*pool, 1, at::tensor(order, at::kLong), longest);
  for (size_t i = 0; i < 3; ++i) {
    const size_t r = (i + 2) % 3;
    const int64_t n = want_k[r].size(0);
    EXPECT_TRUE(at::equal(gk[i].narrow(1, 0, n), want_k[r].transpose(0, 1))) << i;
    EXPECT_TRUE(at::equal(gv[i].narrow(1, 0, n), want_v[r].transpose(0, 1))) << i;
  }
}

// The pool grows what is short, by doubling, and keeps what suffices: rows joining add slots,
// not positions; a row outgrowing the positions doubles them, not the slots.
TEST(RowKeyPool, GrowsOnlyWhatIsShort) {
  RowKeyPool pool(1);
  const int64_t first = pool.acquire();
  pool.append(0, first, tokens(3, 0), tokens(3, 0));
  EXPECT_EQ(pool.capacity(0), std::make_pair(int64_t{1}, int64_t{3}));
  for (int i = 0; i < 4; ++i) pool.append(0, pool.acquire(), tokens(1, i), tokens(1, i));
  EXPECT_EQ(pool.capacity(0), std::make_pair(int64_t{8}, int64_t{3}));  // 1 -> 2 -> 4 -> 8 slots
  pool.append(0, first, tokens(1, 9), tokens(1, 9));
  EXPECT_EQ(pool.capacity(0), std::make_pair(int64_t{8}, int64_t{6}));
}

// A copied slot holds the keys and goes its own way; a released slot is taken again, empty.
TEST(RowKeyPool, CopiedSlotsAreIndependentAndReleasedOnesReused) {
  auto pool = std::make_shared<RowKeyPool>(1);
  RowSlot a(pool, pool->acquire());
  pool->append(0, a.index(), tokens(2, 0), tokens(2, 1));
  RowSlot b = a;
  ASSERT_NE(b.index(), a.index());
  pool->append(0, a.index(), tokens(1, 7), tokens(1, 8));
  EXPECT_EQ(pool->used(0, a.index()), 3);
  EXPECT_EQ(pool->used(0, b.index()), 2);
  EXPECT_TRUE(at::equal(pool->slot_keys(0, b.index()).first, tokens(2, 0).unsqueeze(0)));
  const int64_t freed = b.index();
  RowSlot moved = std::move(b);
  EXPECT_FALSE(static_cast<bool>(b));
  EXPECT_EQ(moved.index(), freed);
  moved.reset();
  EXPECT_EQ(pool->acquire(), freed);
  EXPECT_EQ(pool->used(0, freed), 0);
}

// A released slot taken again holds zeros, not its earlier row's keys: rows_new_keys reads a
// slot's padding (masked, but 0·V must stay finite), so nothing of one client's row, not even a
// non-finite value, reaches the next row's product.
TEST(RowKeyPool, AReusedSlotIsCleared) {
  auto pool = std::make_shared<RowKeyPool>(1);
  const int64_t first = pool->acquire(), other = pool->acquire();
  const at::Tensor nan = at::full({3, kHeads, kDim}, std::nan(""));
  pool->append(0, first, nan, nan);
  pool->append(0, other, tokens(3, 0), tokens(3, 1));
  pool->release(first);
  ASSERT_EQ(pool->acquire(), first);
  const auto [k, v] = gather(*pool, 0, at::tensor({first, other}, at::kLong), 3);
  EXPECT_TRUE(at::equal(k[0], at::zeros_like(k[0])));
  EXPECT_TRUE(at::equal(v[0], at::zeros_like(v[0])));
  EXPECT_TRUE(at::equal(k[1], tokens(3, 0).transpose(0, 1)));  // the other row's untouched
}

// push_rows_keys as lvx serve's steps use it: two rows together (pooled), one of them alone
// (decode_step reads and extends its keys as pieces), then both together again: every row's new
// keys are its tokens in the order they came, and its count says so.
TEST(RowKeyPool, RowsLeavingAndJoiningKeepTheirKeysInOrder) {
  const size_t layers = 2;
  std::vector<DecodeCache> caches(2);
  for (DecodeCache& c : caches) {
    c.new_k.resize(layers);
    c.new_v.resize(layers);
    c.batch = 1;
  }
  std::vector<at::Tensor> want(2);
  auto together = [&](double seed) {
    const at::Tensor k = tokens(3, seed);  // row 0: 1 token, row 1: 2
    for (size_t l = 0; l < layers; ++l)
      lvx::models::push_rows_keys({&caches[0], &caches[1]}, l, k, -k, {1, 2});
    want[0] = want[0].defined() ? at::cat({want[0], k.narrow(0, 0, 1)}) : k.narrow(0, 0, 1);
    want[1] = want[1].defined() ? at::cat({want[1], k.narrow(0, 1, 2)}) : k.narrow(0, 1, 2);
  };
  together(0);
  EXPECT_TRUE(static_cast<bool>(caches[0].pooled));
  together(50);
  // Row 1 alone: its keys leave the pool as pieces, and its step appends one.
  const at::Tensor alone = tokens(1, 900);
  for (size_t l = 0; l < layers; ++l) {
    lvx::models::new_keys(caches[1], l);
    caches[1].new_k[l].push_back(alone.unsqueeze(0));
    caches[1].new_v[l].push_back(-alone.unsqueeze(0));
  }
  EXPECT_FALSE(static_cast<bool>(caches[1].pooled));
  want[1] = at::cat({want[1], alone});
  together(200);
  for (size_t r = 0; r < 2; ++r)
    for (size_t l = 0; l < layers; ++l) {
      ASSERT_EQ(lvx::models::new_key_count(caches[r], l), want[r].size(0)) << r << " " << l;
      const auto [k, v] = lvx::models::new_keys(caches[r], l);
      EXPECT_TRUE(at::equal(k, want[r].unsqueeze(0))) << r << " " << l;
      EXPECT_TRUE(at::equal(v, -want[r].unsqueeze(0))) << r << " " << l;
    }
}

// The batch's stacked prompt keys (RowKeyPool::stacked_keys): three videos' keys stacked in the
// order first asked, each at its place; the same set asked in another order gives the same
// tensors (no copy) and each source's place; a set that differs is stacked anew. Exact.
TEST(RowKeyPool, StackedKeysFollowTheSetNotTheOrder) {
  RowKeyPool pool(1);
  std::vector<std::pair<at::Tensor, at::Tensor>> videos;
  for (int i = 0; i < 4; ++i) {
    const at::Tensor k = tokens(5, 100.0 * i).unsqueeze(0);  // [1, P, Hkv, D]
    videos.emplace_back(k, -k);
  }
  std::vector<int64_t> places;
  const auto [k, v] = pool.stacked_keys(0, {videos[0], videos[1], videos[2]}, places);
  EXPECT_EQ(places, (std::vector<int64_t>{0, 1, 2}));
  ASSERT_EQ(k.sizes(), (std::vector<int64_t>{3, 5, kHeads, kDim}));
  for (int64_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::equal(k[i], videos[static_cast<size_t>(i)].first[0])) << i;
    EXPECT_TRUE(at::equal(v[i], videos[static_cast<size_t>(i)].second[0])) << i;
  }
  EXPECT_EQ(pool.stacked_sources(0), 3U);
  const auto [k2, v2] = pool.stacked_keys(0, {videos[2], videos[0], videos[1]}, places);
  EXPECT_TRUE(k2.is_same(k) && v2.is_same(v));
  EXPECT_EQ(places, (std::vector<int64_t>{2, 0, 1}));
  const auto [k3, v3] = pool.stacked_keys(0, {videos[3], videos[0]}, places);
  EXPECT_FALSE(k3.is_same(k));
  EXPECT_EQ(places, (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(at::equal(k3[0], videos[3].first[0]) && at::equal(v3[1], videos[0].second[0]));
  EXPECT_EQ(pool.stacked_sources(0), 2U);
}

// Rows whose prompt keys join their own keys' product (models/decode.h prompt_front): on one
// rank, several pooled rows whose prompt keys are unmasked, of one shape and few; each row's
// are its own cache's tensors. Any other batch gets none (a call over the prompt keys).
TEST(PromptFront, OnlySmallUnmaskedPromptsOfOneShapeOnOneRank) {
  lvx::models::Parallel par;
  par.pg = std::make_shared<lvx::dist::ProcessGroup>(lvx::dist::RendezvousInfo{});
  auto pool = std::make_shared<RowKeyPool>(1);
  std::vector<DecodeCache> caches(3);
  std::vector<DecodeCache*> rows;
  // Two videos' prompt keys; rows 0 and 2 hold the same tensors (questions about one video).
  const at::Tensor a = tokens(4, 0).unsqueeze(0), b = tokens(4, 50).unsqueeze(0);
  const lvx::models::KVShard video_a{a, -a, {}}, video_b{b, -b, {}};
  for (size_t r = 0; r < 3; ++r) {
    caches[r].prompt = {r == 1 ? video_b : video_a};
    caches[r].pooled = RowSlot(pool, pool->acquire());
    rows.push_back(&caches[r]);
  }
  const lvx::models::PromptFront p = lvx::models::prompt_front(rows, 0, par);
  ASSERT_TRUE(p);
  EXPECT_EQ(p.length, 4);
  ASSERT_EQ(p.keys.size(), 3U);
  for (size_t r = 0; r < 3; ++r)
    EXPECT_TRUE(p.keys[r].first.is_same(caches[r].prompt[0].k) &&
                p.keys[r].second.is_same(caches[r].prompt[0].v))
        << r;
  EXPECT_FALSE(lvx::models::prompt_front({rows[0]}, 0, par));  // one row steps alone
  caches[2].prompt[0].visible = at::ones({1, 4}, at::kBool);   // masked keys
  EXPECT_FALSE(lvx::models::prompt_front(rows, 0, par));
  caches[2].prompt[0] = {tokens(5, 0).unsqueeze(0), tokens(5, 0).unsqueeze(0), {}};  // 5 keys
  EXPECT_FALSE(lvx::models::prompt_front(rows, 0, par));
  for (DecodeCache& c : caches) c.prompt[0] = caches[2].prompt[0];  // one video, 5 keys
  EXPECT_TRUE(lvx::models::prompt_front(rows, 0, par));
  // More than par.prompt_front_elements to copy: rows x P x Hkv x D (3 x 5 x 2 x 3 here).
  par.prompt_front_elements = 3 * 5 * kHeads * kDim - 1;
  EXPECT_FALSE(lvx::models::prompt_front(rows, 0, par));
  par.prompt_front_elements += 1;
  EXPECT_TRUE(lvx::models::prompt_front(rows, 0, par));
  par.prompt_front_elements = 0;  // off
  EXPECT_FALSE(lvx::models::prompt_front(rows, 0, par));
}

// A slot's front (RowKeyPool::set_fronts: a row's prompt keys kept before its own): written
// behind or ahead of own keys already there, kept without a copy while the same tensors are
// asked for, followed by the keys appended later, copied with the slot, dropped again; the
// own keys read back (slot_keys, new_keys) stay the row's own throughout. Exact.
TEST(RowKeyPool, FrontsHoldAPromptBeforeTheOwnKeys) {
  auto pool = std::make_shared<RowKeyPool>(1);
  const int64_t a = pool->acquire(), b = pool->acquire();
  pool->append(0, a, tokens(2, 0), -tokens(2, 0));
  pool->append(0, b, tokens(3, 10), -tokens(3, 10));
  const at::Tensor prompt = tokens(5, 500).unsqueeze(0);  // [1, P, Hkv, D]
  const std::pair<at::Tensor, at::Tensor> front{prompt, -prompt};
  const at::Tensor both = at::tensor(std::vector<int64_t>{a, b}, at::kLong);
  pool->set_fronts(0, {a, b}, {front, front});
  EXPECT_EQ(pool->front(0, a), 5);
  pool->append_rows(0, {a, b}, {1, 1}, tokens(2, 90), -tokens(2, 90));
  const auto [k, v] = gather(*pool, 0, both, 5 + 4);  // [2, Hkv, P + 4, D]
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::equal(k[i].narrow(1, 0, 5), prompt[0].transpose(0, 1))) << i;
    EXPECT_TRUE(at::equal(v[i].narrow(1, 0, 5), -prompt[0].transpose(0, 1))) << i;
  }
  const at::Tensor own_a = at::cat({tokens(2, 0), tokens(2, 90).narrow(0, 0, 1)});
  const at::Tensor own_b = at::cat({tokens(3, 10), tokens(2, 90).narrow(0, 1, 1)});
  EXPECT_TRUE(at::equal(k[0].narrow(1, 5, 3), own_a.transpose(0, 1)));
  EXPECT_TRUE(at::equal(k[1].narrow(1, 5, 4), own_b.transpose(0, 1)));
  EXPECT_TRUE(at::equal(pool->slot_keys(0, b).first, own_b.unsqueeze(0)));
  // The same tensors again: nothing rewritten (changed in place, they would show it if copied).
  const at::Tensor was = prompt.clone();
  prompt.add_(1000);
  pool->set_fronts(0, {a}, {front});
  EXPECT_EQ(pool->front(0, a), 5);
  EXPECT_TRUE(at::equal(gather(*pool, 0, both, 5).first[0], was[0].transpose(0, 1)));
  const int64_t c = pool->copy_of(a);  // the front travels with the slot
  EXPECT_EQ(pool->front(0, c), 5);
  EXPECT_TRUE(at::equal(pool->slot_keys(0, c).second, -own_a.unsqueeze(0)));
  pool->set_fronts(0, {a, b}, {});  // dropped: the own keys first again
  EXPECT_EQ(pool->front(0, a), 0);
  const auto [k0, v0] = gather(*pool, 0, both, 4);
  EXPECT_TRUE(at::equal(k0[0].narrow(1, 0, 3), own_a.transpose(0, 1)));
  EXPECT_TRUE(at::equal(v0[1], -own_b.transpose(0, 1)));
  pool->append(0, a, tokens(1, 70), -tokens(1, 70));
  EXPECT_TRUE(at::equal(pool->slot_keys(0, a).first, at::cat({own_a, tokens(1, 70)}).unsqueeze(0)));
}

}  // namespace
