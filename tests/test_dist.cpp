// Communication layer: every operation at world sizes 1-4 on real rank processes, with inputs
// crafted so the exact result is known (nccl-tests style: each worker counts wrong elements),
// byte counters against the analytic volumes, emulated links, and threads and lifetimes.
// Rendezvous, faults and lvx launch have files of their own (tests/test_dist_*.cpp).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/dist/process_group.h"
#include "src/dist/rendezvous.h"
#include "tests/collective_volumes.h"
#include "tests/multirank.h"

using lvx::dist::P2POp;
using lvx::dist::ProcessGroup;
using lvx::dist::ReduceOp;

namespace {

int g_wrong = 0;  // elements (or counters) that differ from the known answer, per worker

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  if (got.sizes() != want.sizes()) {
    std::cerr << what << ": shape " << got.sizes() << " != " << want.sizes() << "\n";
    ++g_wrong;
    return;
  }
  int64_t bad = got.ne(want).sum().item<int64_t>();
  if (bad) std::cerr << what << ": " << bad << " wrong elements\n";
  g_wrong += static_cast<int>(bad);
}

void expect_bytes(int64_t got, int64_t want, const std::string& what) {
  if (got != want) {
    std::cerr << what << ": counted " << got << " bytes, analytic volume " << want << "\n";
    ++g_wrong;
  }
}

// Rows of a distinct, exactly representable value per (source rank, row, column).
at::Tensor rows(int src, int64_t n, int64_t cols, int tag) {
  auto r = at::arange(n, at::kDouble).unsqueeze(1) * 10 + at::arange(cols, at::kDouble);
  return (r + src * 100000 + tag * 1000000).to(at::kFloat);
}

}  // namespace

// ---- every operation, exact results and byte volumes -------------------------------------

namespace {

// all_ops' rows: columns per row, and the bytes of an element (float32).
constexpr int64_t kCols = 3, kFloatBytes = 4;

// Ring exchange: receive exactly the previous rank's rows; zero-size messages are legal.
void check_ring_exchange(ProcessGroup& pg) {
  const int r = pg.rank(), w = pg.world_size();
  pg.counters().reset();
  at::Tensor send = rows(r, 5, kCols, 1), recv = at::empty({5, kCols});
  pg.ring_exchange(send, recv).wait();
  expect_equal(recv, rows(pg.prev(), 5, kCols, 1), "ring_exchange");
  expect_bytes(pg.counters().total_sent(), w > 1 ? 5 * kCols * kFloatBytes : 0,
               "ring_exchange sent");
  if (w > 1)
    expect_bytes(pg.counters().sent[pg.next()], 5 * kCols * kFloatBytes, "ring sent to next");
  expect_bytes(pg.counters().total_received(), w > 1 ? 5 * kCols * kFloatBytes : 0,
               "ring received");
  at::Tensor e0 = at::empty({0, kCols}), e1 = at::empty({0, kCols});
  pg.ring_exchange(e0, e1).wait();
  expect_bytes(pg.counters().total_sent(), w > 1 ? 5 * kCols * kFloatBytes : 0,
               "zero-size adds nothing");
}

// Batched send/recv in the "wrong" order (recv posted first) must not deadlock (w > 1).
void check_batch_recv_first(ProcessGroup& pg) {
  const int r = pg.rank();
  at::Tensor recv = at::empty({2, kCols});
  pg.batch_isend_irecv({P2POp::recv(recv, pg.prev()), P2POp::send(rows(r, 2, kCols, 2), pg.next())})
      .wait();
  expect_equal(recv, rows(pg.prev(), 2, kCols, 2), "batch recv-first");
}

// All-gather: even (4 rows each), nearly even (3 or 2 rows: shard_range's chunks, padded on the
// engine) and uneven (rank j contributes 2j rows; rank 0 none), on Gloo's default (lvx's ring,
// counted per message) and on Gloo's own (CollectiveImpl::kEngine, formula-counted).
void check_all_gather(ProcessGroup& pg) {
  const int r = pg.rank(), w = pg.world_size();
  for (const auto impl : {lvx::dist::CollectiveImpl::kAuto, lvx::dist::CollectiveImpl::kEngine})
    for (int uneven = 0; uneven < 3; ++uneven) {
      pg.set_collectives(impl);
      pg.counters().reset();
      std::vector<int64_t> sizes(w);
      for (int j = 0; j < w; ++j)
        sizes[j] = uneven == 2 ? 2 * j : uneven == 1 ? (j < 2 ? 3 : 2) : 4;
      at::Tensor got =
          pg.all_gather(rows(r, sizes[r], kCols, 3), uneven ? sizes : std::vector<int64_t>{});
      pg.set_collectives(lvx::dist::CollectiveImpl::kAuto);
      std::vector<at::Tensor> parts;
      for (int j = 0; j < w; ++j) parts.push_back(rows(j, sizes[j], kCols, 3));
      expect_equal(got, at::cat(parts), uneven == 2 ? "all_gather uneven" : "all_gather");
      const bool engine = impl == lvx::dist::CollectiveImpl::kEngine;
      const auto [sent, received] =
          engine ? lvx::test::all_gather_volume(r, sizes, kCols * kFloatBytes, false)
                 : lvx::test::ring_all_gather_volume(r, sizes, kCols * kFloatBytes);
      expect_bytes(pg.counters().total_sent(), sent, "all_gather sent");
      expect_bytes(pg.counters().total_received(), received, "all_gather received");
      // An engine collective: every byte of it is formula-counted; the ring's none.
      expect_bytes(pg.counters().formula_sent, engine ? sent : 0, "all_gather formula-counted");
    }
}

// All-reduce: x_r[i] = r * i + 1 → Σ = i·w(w−1)/2 + w, max = (w−1)·i + 1, min = 1.
void check_all_reduce(ProcessGroup& pg) {
  const int r = pg.rank(), w = pg.world_size();
  const int64_t n = 12 * w;  // divisible by w: volume is exactly 2(w−1)/w · S each way
  at::Tensor i = at::arange(n, at::kFloat);
  pg.counters().reset();
  at::Tensor s = i * r + 1;
  pg.all_reduce(s, ReduceOp::kSum);
  expect_equal(s, i * (w * (w - 1) / 2) + w, "all_reduce sum");
  expect_bytes(pg.counters().total_sent(), 2 * (w - 1) * (n / w) * kFloatBytes, "all_reduce sent");
  // Gloo's own from 3 ranks (formula-counted), lvx's ring at 2 (counted per message).
  expect_bytes(pg.counters().formula_received, w == 2 ? 0 : 2 * (w - 1) * (n / w) * kFloatBytes,
               "all_reduce formula-counted");
  expect_bytes(pg.counters().total_received(), 2 * (w - 1) * (n / w) * kFloatBytes,
               "all_reduce recv");
  at::Tensor m = i * r + 1;
  pg.all_reduce(m, ReduceOp::kMax);
  expect_equal(m, i * (w - 1) + 1, "all_reduce max");
  at::Tensor mn = i * r + 1;
  pg.all_reduce(mn, ReduceOp::kMin);
  expect_equal(mn, at::ones_like(i), "all_reduce min");
  at::Tensor odd = at::full({5}, static_cast<float>(r + 1));  // fewer elements than some w·chunks
  pg.all_reduce(odd);
  expect_equal(odd, at::full({5}, static_cast<float>(w * (w + 1) / 2)), "all_reduce small");
}

// Reduce-scatter: rank r gets the sum of chunk shard_range(n, w, r), n not divisible by w;
// each rank sends and receives (w−1) chunks, the sizes of chunks r−1 … r−w+1 (sent) and
// r−2 … r−w (received).
void check_reduce_scatter(ProcessGroup& pg) {
  const int r = pg.rank(), w = pg.world_size();
  const int64_t n = 12 * w + 1;
  at::Tensor i = at::arange(n, at::kFloat);
  pg.counters().reset();
  at::Tensor x = i * r + 1;
  const at::Tensor got = pg.reduce_scatter(x);
  const auto [b, e] = lvx::dist::shard_range(n, w, r);
  expect_equal(got, (i * (w * (w - 1) / 2) + w).narrow(0, b, e - b), "reduce_scatter sum");
  int64_t sent = 0, recv = 0;
  for (int s = 0; s + 1 < w; ++s) {
    const auto cs = lvx::dist::shard_range(n, w, (r - s - 1 + 2 * w) % w);
    const auto cr = lvx::dist::shard_range(n, w, (r - s - 2 + 3 * w) % w);
    sent += (cs.second - cs.first) * kFloatBytes;
    recv += (cr.second - cr.first) * kFloatBytes;
  }
  expect_bytes(pg.counters().total_sent(), sent, "reduce_scatter sent");
  expect_bytes(pg.counters().total_received(), recv, "reduce_scatter recv");
}

// All-to-all with uneven splits, zeros included: rank a sends (a + b) % 3 rows to rank b.
void check_all_to_all(ProcessGroup& pg) {
  const int r = pg.rank(), w = pg.world_size();
  pg.counters().reset();
  std::vector<int64_t> send(w), recv(w);
  for (int j = 0; j < w; ++j) {
    send[j] = (r + j) % 3;
    recv[j] = (j + r) % 3;
  }
  std::vector<at::Tensor> in_parts, want_parts;
  for (int j = 0; j < w; ++j) in_parts.push_back(rows(r, send[j], kCols, 10 + j));
  for (int j = 0; j < w; ++j) want_parts.push_back(rows(j, recv[j], kCols, 10 + r));
  at::Tensor got = pg.all_to_all(at::cat(in_parts), send, recv);
  expect_equal(got, at::cat(want_parts), "all_to_all");
  int64_t want_sent = 0, want_recv = 0;
  for (int j = 0; j < w; ++j)
    if (j != r)
      want_sent += send[j] * kCols * kFloatBytes, want_recv += recv[j] * kCols * kFloatBytes;
  expect_bytes(pg.counters().total_sent(), want_sent, "all_to_all sent");
  expect_bytes(pg.counters().total_received(), want_recv, "all_to_all received");
}

// Broadcast from the last rank.
void check_broadcast(ProcessGroup& pg) {
  const int r = pg.rank(), w = pg.world_size();
  pg.counters().reset();
  at::Tensor t = r == w - 1 ? rows(r, 3, kCols, 4) : at::zeros({3, kCols});
  pg.broadcast(t, w - 1);
  expect_equal(t, rows(w - 1, 3, kCols, 4), "broadcast");
  // Gloo's binomial tree: the root sends to ⌈log2 w⌉ peers at most, the others forward.
  expect_bytes(pg.counters().total_sent(),
               lvx::test::tree_sends(r, w - 1, w) * 3 * kCols * kFloatBytes, "broadcast sent");
  expect_bytes(pg.counters().total_received(), r == w - 1 ? 0 : 3 * kCols * kFloatBytes,
               "broadcast received");
}

}  // namespace

LVX_WORKER(all_ops) {
  auto pg = ProcessGroup::from_env();
  const int r = pg->rank(), w = pg->world_size();
  pg->check_agreement("test", "all_ops");
  check_ring_exchange(*pg);
  if (w > 1) check_batch_recv_first(*pg);
  check_all_gather(*pg);
  check_all_reduce(*pg);
  check_reduce_scatter(*pg);
  check_all_to_all(*pg);
  check_broadcast(*pg);
  pg->barrier();
  if (g_wrong) std::cerr << "rank " << r << ": " << g_wrong << " wrong\n";
  return g_wrong ? 1 : 0;
}

class DistOps : public ::testing::TestWithParam<int> {};

TEST_P(DistOps, EveryOperationExactWithAnalyticBytes) {
  lvx::testing::expect_all_ok(lvx::testing::run_ranks(GetParam(), "all_ops", 120));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, DistOps, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// LVX_DIST_COLLECTIVES=p2p: the collectives as lvx's rings of messages (collectives_p2p.cpp),
// exact, every byte counted per message (none formula-counted): all_gather's ring forwards the
// pieces as they are (rank r sends those of r, r − 1, …, r − w + 2), broadcast is a star.
LVX_WORKER(p2p_collectives) {
  auto pg = ProcessGroup::from_env();
  const int r = pg->rank(), w = pg->world_size();
  const int64_t cols = 3, fb = 4;
  pg->counters().reset();
  std::vector<int64_t> sizes(w);
  for (int j = 0; j < w; ++j) sizes[j] = 2 * j + 1;
  at::Tensor got = pg->all_gather(rows(r, sizes[r], cols, 3), sizes);
  std::vector<at::Tensor> parts;
  for (int j = 0; j < w; ++j) parts.push_back(rows(j, sizes[j], cols, 3));
  expect_equal(got, at::cat(parts), "p2p all_gather");
  int64_t sent = 0;
  for (int s = 0; s + 1 < w; ++s) sent += sizes[(r - s + w) % w] * cols * fb;
  expect_bytes(pg->counters().total_sent(), sent, "p2p all_gather sent");
  at::Tensor i = at::arange(12 * w + 1, at::kFloat);
  at::Tensor x = i * r + 1;
  pg->all_reduce(x);
  expect_equal(x, i * (w * (w - 1) / 2) + w, "p2p all_reduce");
  at::Tensor y = i * r + 1;
  const auto [b, e] = lvx::dist::shard_range(i.numel(), w, r);
  expect_equal(pg->reduce_scatter(y), (i * (w * (w - 1) / 2) + w).narrow(0, b, e - b),
               "p2p reduce_scatter");
  pg->counters().reset();
  at::Tensor t = r == 0 ? rows(0, 3, cols, 4) : at::zeros({3, cols});
  pg->broadcast(t, 0);
  expect_equal(t, rows(0, 3, cols, 4), "p2p broadcast");
  expect_bytes(pg->counters().total_sent(), r == 0 ? (w - 1) * 3 * cols * fb : 0,
               "p2p broadcast sent (star)");
  expect_bytes(pg->counters().formula_sent, 0, "p2p: nothing formula-counted");
  pg->barrier();
  return g_wrong ? 1 : 0;
}

TEST(DistOps, PointToPointCollectivesExactAtWorld3) {
  lvx::testing::expect_all_ok(
      lvx::testing::run_ranks(3, "p2p_collectives", 120, {{"LVX_DIST_COLLECTIVES", "p2p"}}));
}

// ---- emulated links (src/dist/emulated_cluster.h) -----------------------------------------

// 4 ranks as 2 emulated nodes: every rank exchanges `bytes` with its partner on the other node at
// once (node 0's link carries two flows each way), then with its partner on its own node. Rank 0
// prints the per-node inter-node rate and the intra-node pair's rate in bytes per second.
LVX_WORKER(emulated_rates) {
  auto pg = ProcessGroup::from_env();
  const int r = pg->rank();
  const int64_t bytes = std::atoll(std::getenv("LVX_TEST_BYTES"));
  auto exchange = [&](int peer) {
    at::Tensor send = at::ones({bytes / 4}), recv = at::empty({bytes / 4});
    pg->barrier();
    const auto t0 = std::chrono::steady_clock::now();
    pg->batch_isend_irecv({P2POp::send(send, peer), P2POp::recv(recv, peer)}).wait();
    pg->barrier();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  exchange((r + 2) % 4);  // warm-up: connections made, the shaper's bucket drained
  const double inter = exchange((r + 2) % 4);
  const double intra = exchange(r ^ 1);
  if (r == 0)
    std::cout << "inter " << 2.0 * static_cast<double>(bytes) / inter << " intra "
              << static_cast<double>(bytes) / intra << "\n";
  return 0;
}

// The rate between emulated nodes is the shaped one (within 20 %), and traffic inside a node is
// not held to it; with --intra-node, each rank's link inside its node is shaped too. Both are
// exchanges (each rank sends and receives at once), so this also checks that a pair's two
// directions do not take turns (process_group.cpp, gloo_options). Skipped, with the reason,
// where this process may not make a network namespace or tc is missing.
TEST(EmulatedLinks, TrafficBetweenNodesRunsAtTheShapedRate) {
  const double inter = 10e6, intra = 5e6;  // 80mbit per node, 40mbit per rank
  auto run = [&](double intra_rate) {
    lvx::dist::LaunchOptions o;
    o.nproc = 4;
    o.nodes = 2;
    o.capture = true;
    o.timeout_s = 60;
    o.links.inter_node_bytes_per_s = inter;
    o.links.intra_node_bytes_per_s = intra_rate;
    o.env = {{"LVX_TEST_WORKER", "emulated_rates"}, {"LVX_TEST_BYTES", "2000000"}};
    return lvx::dist::launch_local({lvx::dist::self_executable()}, o);
  };
  lvx::dist::LaunchResult res;
  try {
    res = run(0);
  } catch (const lvx::Error& e) {
    GTEST_SKIP() << "no emulated links here: " << e.what();
  }
  ASSERT_EQ(res.exit_code, 0) << res.ranks[0].output << res.ranks[1].output;
  double got_inter = 0, got_intra = 0;
  auto rates = [&](const std::string& out) {  // rank 0's "inter X intra Y" line
    const size_t at = out.find("inter ");
    return at != std::string::npos &&
           std::sscanf(out.c_str() + at, "inter %lf intra %lf", &got_inter, &got_intra) == 2;
  };
  ASSERT_TRUE(rates(res.ranks[0].output)) << res.ranks[0].output;
  std::cout << "shaped 10 MB/s per node: measured " << got_inter / 1e6 << " MB/s between nodes, "
            << got_intra / 1e6 << " MB/s inside a node (unshaped)\n";
  EXPECT_NEAR(got_inter, inter, 0.2 * inter);
  EXPECT_GT(got_intra, 3 * inter);
  res = run(intra);
  ASSERT_EQ(res.exit_code, 0) << res.ranks[0].output;
  ASSERT_TRUE(rates(res.ranks[0].output)) << res.ranks[0].output;
  std::cout << "with 5 MB/s per rank inside a node: " << got_intra / 1e6 << " MB/s\n";
  EXPECT_NEAR(got_intra, intra, 0.2 * intra);
  EXPECT_NEAR(got_inter, inter, 0.2 * inter);
}

// ---- threads and lifetimes ---------------------------------------------------------------

// Several threads of one rank post and wait at once (autograd's backward thread runs lvx's
// messages while the main thread may post its own): every message gets a tag of its own and is
// counted exactly once, so the counters sum exactly and nothing hangs on a duplicated tag.
LVX_WORKER(threads) {
  auto pg = ProcessGroup::from_env();
  const int threads = 4, iters = 150;
  const int64_t elems = 1000, bytes = elems * 4;
  pg->reset_counters();
  std::vector<std::thread> ts;
  std::vector<int> wrong(threads, 0);
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      try {
        for (int i = 0; i < iters; ++i) {
          at::Tensor send = at::full({elems}, 7.0f), recv = at::empty({elems});
          pg->ring_exchange(send, recv, "threads").wait();
          if (!recv.eq(7.0f).all().item<bool>()) ++wrong[t];
          if (i % 16 == 0) (void)pg->counters_snapshot();  // reads while others count
        }
      } catch (const lvx::Error& e) {
        std::cerr << "thread " << t << ": " << e.what() << "\n";
        ++wrong[t];
      }
    });
  }
  for (auto& th : ts) th.join();
  for (int w : wrong) g_wrong += w;
  const lvx::dist::ByteCounters c = pg->counters_snapshot();
  expect_bytes(c.sent[pg->next()], threads * iters * bytes, "threads sent");
  expect_bytes(c.received[pg->prev()], threads * iters * bytes, "threads received");
  if (!(c.wait_seconds >= 0)) ++g_wrong;
  pg->barrier();
  return g_wrong ? 1 : 0;
}

TEST(DistThreads, CountersFromFourThreadsSumExactly) {
  lvx::testing::expect_all_ok(
      lvx::testing::run_ranks(2, "threads", 120, {{"OMP_NUM_THREADS", "1"}}));
}

// A Work never outlives its group as a raw pointer: waiting for one whose group is gone is an
// error naming it, and destroying one is harmless.
TEST(DistThreads, WorkOutlivingItsGroupIsAnError) {
  lvx::dist::Work w, unwaited;
  {
    ProcessGroup pg(lvx::dist::RendezvousInfo{});
    w = pg.batch_isend_irecv({}, "probe");
    unwaited = pg.batch_isend_irecv({}, "unwaited");
    ASSERT_TRUE(w.valid());
  }
  try {
    w.wait();
    ADD_FAILURE() << "no error";
  } catch (const lvx::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("probe", 0), 0u) << msg;
    EXPECT_NE(msg.find(": waited for after its process group was destroyed"), std::string::npos)
        << msg;
  }
  w.wait();                      // once reported, waiting again is a no-op
  unwaited = lvx::dist::Work();  // destroys the old one: no wait on a dead group, no throw
}
