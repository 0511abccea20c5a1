// The whole-memory model of training (src/planner/train_memory.h) and its data-parallel traffic
// (train_traffic.h) against byte counts and times worked out by hand for a tiny model, and `lvx
// plan --train --max-frames` end to end.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "src/common/error.h"
#include "src/planner/decode_price.h"
#include "src/planner/inference_memory.h"
#include "src/planner/question_price.h"
#include "src/planner/train_memory.h"
#include "src/planner/train_traffic.h"
#include "tests/build_paths.h"

namespace {

using namespace lvx::planner;

// One LM block: hidden 8, 2 heads and 1 K/V head of 4, MLP 16; vocab 10; no vision.
ModelConfig tiny() {
  ModelConfig m;
  m.name = "tiny";
  m.dtype = "fp32";
  AttentionLayerConfig l;
  l.kind = LayerKind::kSelf;
  l.hidden_size = 8;
  l.heads = 2;
  l.kv_heads = 1;
  l.head_dim = 4;
  l.mlp_size = 16;
  m.layers = {l};
  return m;
}

TEST(TrainMemory, ParameterCountsByHand) {
  // Block: q 8·8+8, k and v 2·(8·4+4), o 8·8, MLP 3·8·16, norms 2·8 = 608; embeddings and head
  // 2·10·8 + final norm 8 = 168.
  const ParamCounts p = estimate_parameters(tiny(), 10, "vision");
  EXPECT_EQ(p.total, 776);
  EXPECT_EQ(p.trainable, 776);
  EXPECT_EQ(p.max_block, 608);
  EXPECT_EQ(p.root, 168);
  // LoRA r=2 on q (8→8), k, v (8→4), o (8→8), gate, up (8→16), down (16→8): 2·128.
  EXPECT_EQ(lora_parameters(tiny(), 2), 256);
}

// A question's memory per rank (src/planner/inference_memory.h), term by term: the tiny model
// with a cross layer (kv 4 wide), 8-wide visual features from a 4-wide tower of MLP 6; 2 frames of
// 3 tokens, 10 prompt tokens, 2 generated, 2 ranks, fp32.
TEST(InferenceMemory, ByHand) {
  ModelConfig m = tiny();
  AttentionLayerConfig cross = m.layers[0];
  cross.kind = LayerKind::kCross;
  m.layers.push_back(cross);
  m.visual_feature_dim = 8;
  m.vision.hidden_size = 4;
  m.vision.mlp_size = 6;
  ParamCounts pc;
  pc.total = 776;
  pc.vocab = 10;
  const InferenceMemory t = inference_memory(m, pc, 2, 10, 3, 2, 2, 4);
  EXPECT_DOUBLE_EQ(t.weights, 4 * 776);               // every rank holds them
  EXPECT_DOUBLE_EQ(t.visual, 3 * 4 * (8 + 12 + 12));  // 3 tokens a rank: features + tower
  EXPECT_DOUBLE_EQ(t.kv_cache, (5 + 2) * 2 * 4 * 4 + 3 * 2 * 4 * 4);  // self, then cross
  EXPECT_DOUBLE_EQ(t.activations, 5 * (24 + 32 + 8 + 8) * 4);
  EXPECT_DOUBLE_EQ(t.logits, 80);
  EXPECT_DOUBLE_EQ(t.total, 3104 + 384 + 320 + 1440 + 80);
}

// 2 nodes of 4 GPUs: 100 GB/s and 10 µs inside a node, 25 GB/s per node and 20 µs between.
ClusterConfig two_nodes() {
  ClusterConfig c;
  c.name = "two";
  c.gpus_per_node = 4;
  c.nodes = 2;
  c.intra_node = {100e9, 10e-6};
  c.inter_node = {25e9, 20e-6};
  return c;
}

// Decoding priced per token (src/planner/decode_price.h), term by term, on the tiny model with a
// cross layer (Hq 2, Hkv 1, D 4): 2 frames of 3 tokens, 10 prompt tokens, batch 1, fp32, W = 1 MB.
TEST(DecodePrice, ByHand) {
  ModelConfig m = tiny();
  AttentionLayerConfig cross = m.layers[0];
  cross.kind = LayerKind::kCross;
  m.layers.push_back(cross);
  ClusterConfig c = two_nodes();
  c.memory = {1e9, false};  // 1 GB/s, each GPU its own
  DecodeShape s;
  s.frames = 2;
  s.tokens_per_frame = 3;
  s.text_tokens = 10;
  s.elem_bytes = 4;
  s.weight_bytes = 1'000'000;
  const double kt = 2 * 10 * 1 * 4 * 4, kv = 2 * 6 * 1 * 4 * 4;  // 320 and 192 bytes
  // 1 rank: the weights and every K/V, no message.
  DecodePrice p = price_decode(m, c, s, 1, true);
  EXPECT_DOUBLE_EQ(p.read_s, (1e6 + kt + kv) / 1e9);
  EXPECT_EQ(p.messages, 0);
  // 4 ranks (one node: 100 GB/s, 10 µs), every rank decoding: each reads W and a quarter of the
  // K/V; both layers all-gather their partials (2·(4+1)·4 = 40 bytes) in 3 hops.
  p = price_decode(m, c, s, 4, false);
  EXPECT_DOUBLE_EQ(p.read_s, (1e6 + (kt + kv) / 4) / 1e9);
  EXPECT_NEAR(p.messages_s, 2 * 3 * (10e-6 + 40 / 100e9), 1e-15);
  EXPECT_EQ(p.bytes_sent, 2 * 3 * 40);
  EXPECT_EQ(p.messages, 2 * 6);
  // Rank 0 alone: W, the whole prompt's keys, its quarter of the visual ones; only the cross
  // layer's query (2·4·4 = 32 bytes) to 3 ranks and their partials back.
  p = price_decode(m, c, s, 4, true);
  EXPECT_DOUBLE_EQ(p.read_s, (1e6 + kt + kv / 4) / 1e9);
  EXPECT_NEAR(p.messages_s, 2 * 10e-6 + 3 * (32 + 40) / 100e9, 1e-15);
  EXPECT_EQ(p.bytes_sent, 3 * 32);
  // 8 ranks span both nodes: the node link (25 GB/s, 20 µs) prices the messages.
  p = price_decode(m, c, s, 8, true);
  EXPECT_NEAR(p.messages_s, 2 * 20e-6 + 7 * (32 + 40) / 25e9, 1e-15);
  // A CPU host (memory shared by its 4 local ranks, cores shared: sync 1 ms per collective):
  // every rank decoding reads 4 W over one bus; rank 0 alone reads W once.
  c.memory.shared = true;
  c.intra_node.sync_s = 1e-3;
  EXPECT_DOUBLE_EQ(price_decode(m, c, s, 4, false).read_s, (4e6 + kt + kv) / 1e9);
  EXPECT_DOUBLE_EQ(price_decode(m, c, s, 4, true).read_s, (1e6 + kt + kv) / 1e9);
  EXPECT_NEAR(price_decode(m, c, s, 4, true).messages_s, 2 * 10e-6 + 3 * (32 + 40) / 100e9 + 1e-3,
              1e-15);
  // W counts the decoder's layers and a head of vocab × the last width: (776 + 10·8)·2.
  EXPECT_EQ(decode_weight_bytes(m, 776, 10, 2), 1712);
  // No memory figure: no price, and the error says which field.
  c.memory = {};
  EXPECT_FALSE(can_price_decode(c));
  try {
    price_decode(m, c, s, 2, true);
    ADD_FAILURE() << "priced without a bandwidth";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("memory.bandwidth_gb_per_s"), std::string::npos);
  }
}

// A question's price (src/planner/question_price.h): the vision tower's FLOPs by hand (a 4 px
// image of 2 px patches: T = 4 tokens; width 4, MLP 6, 1 layer), the prefill's compute at the
// GEMM rate, and --nproc auto's choice: on a host whose ranks share memory and cores more ranks
// only add messages (1 rank wins); on GPUs each rank adds its own compute and memory (more win).
TEST(QuestionPrice, ByHandAndTheRankChoice) {
  ModelConfig m = tiny();
  AttentionLayerConfig cross = m.layers[0];
  cross.kind = LayerKind::kCross;
  cross.mask = MaskRule::kMediaUpTo;
  m.layers.push_back(cross);
  m.visual_feature_dim = 8;
  m.visual_tokens_per_frame = 4;
  m.vision = {4, 1, 1, 6, 4, 2};  // hidden, layers, heads, mlp, image, patch
  // Patch embedding 2·4·4·3·2² = 384; the layer 2·4·(4·16 + 2·4·6) + 4·4²·4 = 1152.
  EXPECT_DOUBLE_EQ(vision_flops_per_image(m), 384 + 1152);
  ClusterConfig c = two_nodes();
  c.attention["fp32"] = {1e12, 1e12};
  c.gemm_flops["fp32"] = 1e9;  // 1 GFLOP/s a device
  c.device_memory_bytes = int64_t{1} << 30;
  c.memory = {1e9, false};
  QuestionShape q;
  q.frames = 4;
  q.text_tokens = 16;
  q.tokens_per_frame = 4;
  q.new_tokens = 5;
  q.dtype = "fp32";
  q.lm_parameters = 608;
  q.weight_bytes = 4 * 608;
  // 4 images, the LM over 16 tokens, the cross layer's K/V projection of 16 visual tokens.
  const double flops = 4 * 1536.0 + 2 * 608 * 16 + 2 * 16 * 8 * 2 * 4;
  const QuestionPrice one = price_question(m, c, q, 1);
  EXPECT_DOUBLE_EQ(one.compute_s, flops / 1e9);
  EXPECT_GT(one.attention_s, 0);
  EXPECT_DOUBLE_EQ(one.total_s, one.compute_s + one.attention_s + 4 * one.decode_s);
  EXPECT_DOUBLE_EQ(price_question(m, c, q, 4).compute_s, flops / 4e9);  // 4 GPUs, 4 rates
  // A 1-hour question on GPUs: 4 ranks end sooner; on a shared host 1 rank does.
  q.frames = 1800;
  q.text_tokens = 1900;
  std::vector<QuestionPrice> gpus, host;
  for (int n = 1; n <= 4; ++n) gpus.push_back(price_question(m, c, q, n));
  EXPECT_EQ(fastest_ranks(gpus), 4);
  c.memory.shared = true;
  c.intra_node.sync_s = 1e-3;
  for (int n = 1; n <= 4; ++n) host.push_back(price_question(m, c, q, n));
  EXPECT_EQ(fastest_ranks(host), 1);
  EXPECT_DOUBLE_EQ(host[3].compute_s, host[0].compute_s);  // the host's cores whatever n
}

TEST(TrainTraffic, CollectivesPricedByHand) {
  const ClusterConfig c = two_nodes();
  // One node, 4 ranks, all-reduce of 1 GB: 2·3/4·1e9 / 100e9 s + 2·3 latencies of 10 µs.
  EXPECT_NEAR(collective_seconds(CollectiveKind::kAllReduce, 1e9, 4, c), 0.015 + 6e-5, 1e-12);
  EXPECT_DOUBLE_EQ(collective_bytes_sent(CollectiveKind::kAllReduce, 1e9, 4), 1.5e9);
  // 8 ranks on 2 nodes, reduce-scatter: the node link's 1/2·1e9 / 25e9 = 0.02 s outweighs
  // NVLink's 3/4·1e9 / 100e9; 7 inter-node latencies.
  EXPECT_NEAR(collective_seconds(CollectiveKind::kReduceScatter, 1e9, 8, c), 0.02 + 7 * 20e-6,
              1e-12);
  EXPECT_DOUBLE_EQ(collective_bytes_sent(CollectiveKind::kAllGather, 8e6, 8), 7e6);
  EXPECT_EQ(collective_seconds(CollectiveKind::kAllGather, 1e9, 1, c), 0);
}

TEST(TrainTraffic, StagesRunTheirCollectivesByHand) {
  const ModelConfig m = tiny();
  const ParamCounts p = estimate_parameters(m, 10, "vision");  // Ψ 776, Ψ_last 608
  const ClusterConfig c = two_nodes();
  TrainMemoryOptions o;
  o.elem_bytes = 2;
  o.ranks = 8;
  o.grad_accum = 3;
  o.shard = "none";  // 3 all-reduces of 4Ψ: 3 · 2·7/8 · 3104 bytes sent
  TrainTraffic t = train_traffic(m, p, o, c);
  ASSERT_EQ(t.items.size(), 1u);
  EXPECT_EQ(t.items[0].calls, 3);
  EXPECT_DOUBLE_EQ(t.sent, 3 * 2 * 7.0 / 8 * 3104);
  EXPECT_DOUBLE_EQ(t.seconds, 3 * collective_seconds(CollectiveKind::kAllReduce, 3104, 8, c));
  o.shard = "optimizer";  // one reduce-scatter of 4Ψ, one all-gather of 2Ψ
  t = train_traffic(m, p, o, c);
  EXPECT_DOUBLE_EQ(t.sent, 7.0 / 8 * 3104 + 7.0 / 8 * 1552);
  o.shard = "gradients";  // 3 reduce-scatters, one all-gather
  t = train_traffic(m, p, o, c);
  EXPECT_DOUBLE_EQ(t.sent, 3 * 7.0 / 8 * 3104 + 7.0 / 8 * 1552);
  o.shard = "parameters";  // 3 reduce-scatters, 3 all-gathers of 2·(2Ψ − Ψ_last) = 1888 bytes
  t = train_traffic(m, p, o, c);
  EXPECT_DOUBLE_EQ(t.sent, 3 * 7.0 / 8 * 3104 + 3 * 7.0 / 8 * 1888);
  // LoRA r 2: Ψ = 256 adapter elements in fp32, Ψ_last = 256 / 1 layer: 3 reduce-scatters of
  // 4Ψ, 3 all-gathers of 4·(2Ψ − Ψ_last) = 1024; and the layer's 608 frozen elements (2 bytes
  // each), gathered for the forward and the backward but the last layer's once: 2·(2·608 − 608).
  o.lora_r = 2;
  t = train_traffic(m, p, o, c);
  ASSERT_EQ(t.items.size(), 3u);
  EXPECT_DOUBLE_EQ(t.sent, 3 * 7.0 / 8 * 1024 + 3 * 7.0 / 8 * 1024 + 3 * 7.0 / 8 * 1216);
  o.shard = "gradients";  // nothing frozen moves below stage 3
  EXPECT_EQ(train_traffic(m, p, o, c).items.size(), 2u);
}

TEST(TrainMemory, BreakdownByHand) {
  const ModelConfig m = tiny();
  const ParamCounts p = estimate_parameters(m, 10, "vision");
  TrainMemoryOptions o;
  o.elem_bytes = 4;
  o.ranks = 1;
  // 10 text tokens, no frames, fp32, one rank, no sharding.
  TrainMemory t = train_memory(m, p, 0, 10, 0, o, 0);
  EXPECT_DOUBLE_EQ(t.weights, 4 * 776);
  EXPECT_DOUBLE_EQ(t.optimizer, 12 * 776);
  EXPECT_DOUBLE_EQ(t.gradients, 4 * 776);
  // Per token: block (4·8 + 4·16)·4 = 384, attention q,k,v,o (8+4+4+8)·4 + lse 2·4 = 104,
  // logits (4 + 8)·10 = 120.
  EXPECT_DOUBLE_EQ(t.activations, 10 * (384 + 104 + 120));
  // Two K/V blocks in flight 2·10·(2·4)·4, fp32 accumulators 10·(8·4 + 8·4 + 2·4·4).
  EXPECT_DOUBLE_EQ(t.attention, 640 + 960);
  EXPECT_DOUBLE_EQ(t.total, 3104 + 9312 + 6080 + 1600 + 3104);
  // Stage gradients over 4 ranks: optimizer state /4; gradients layer by layer: the root's
  // buffer 4·168 and the one layer's 4·608 (two layers at most, here there is one), this rank's
  // shard 776 (fp32: no copy); at the update the shard and the gathered parameters 4·776.
  o.shard = "gradients";
  o.ranks = 4;
  o.sp_size = 1;  // 4 data-parallel ranks: activations of the whole sample on each
  t = train_memory(m, p, 0, 10, 0, o, 0);
  EXPECT_DOUBLE_EQ(t.optimizer, 12 * 776 / 4.0);
  EXPECT_DOUBLE_EQ(t.gradients, 4 * (168 + 608) + 776);
  EXPECT_DOUBLE_EQ(t.total, 3104 + 2328 + 6080 + 1600 + 3880);
  // Stage parameters: the same gradients at the reduction, weights the root and the layer (all
  // of them here: one layer), nothing gathered at the update.
  o.shard = "parameters";
  t = train_memory(m, p, 0, 10, 0, o, 0);
  EXPECT_DOUBLE_EQ(t.weights, 4 * (168 + 608));
  EXPECT_DOUBLE_EQ(t.gradients, 4 * (168 + 608) + 776);
  o.shard = "gradients";
  // Sequence parallel over the 4 ranks: a quarter of the tokens' activations.
  o.sp_size = 4;
  EXPECT_DOUBLE_EQ(train_memory(m, p, 0, 10, 0, o, 0).activations, 10 / 4.0 * (384 + 104 + 120));
  // fits compares the peak with the device's memory.
  EXPECT_FALSE(train_memory(m, p, 0, 10, 0, o, 100).fits);
  // A peak that fits the device but not the device less the default reserve does not fit.
  const double peak = train_memory(m, p, 0, 10, 0, o, 0).total;
  const double device = (peak + 1.5 * double(int64_t{1} << 30)) / 0.92 - 1;
  EXPECT_FALSE(train_memory(m, p, 0, 10, 0, o, device).fits);
  o.reserve_bytes = 0;
  EXPECT_TRUE(train_memory(m, p, 0, 10, 0, o, peak).fits);
  EXPECT_TRUE(train_memory(m, p, 0, 10, 0, o, 1e9).fits);
}

// LoRA on the activation path: the frozen base in the model dtype, the adapter in fp32, r·e per
// token per adapted projection; at stage parameters the layer's frozen weights 1/n per rank plus
// the layers gathered at a time (here the one layer, whole).
TEST(TrainMemory, LoraByHand) {
  const ModelConfig m = tiny();
  const ParamCounts p = estimate_parameters(m, 10, "vision");  // Ψ 776: layer 608, root 168
  EXPECT_EQ(p.layers, 608);
  EXPECT_EQ(p.max_layer, 608);
  TrainMemoryOptions o;
  o.elem_bytes = 4;
  o.ranks = 4;
  o.sp_size = 1;
  o.lora_r = 2;  // 256 adapter elements
  TrainMemory t = train_memory(m, p, 0, 10, 0, o, 0);
  EXPECT_DOUBLE_EQ(t.weights, 4 * 776 + 4 * 256);
  EXPECT_DOUBLE_EQ(t.optimizer, 12 * 256);
  // Per token: the block's 608 bytes as in BreakdownByHand, and x·Aᵀ of 7 projections, 2·4 each.
  EXPECT_DOUBLE_EQ(t.activations, 10 * (384 + 104 + 120) + 10 * 7 * 2 * 4);
  o.shard = "parameters";
  t = train_memory(m, p, 0, 10, 0, o, 0);
  // Root 168 replicated, the adapter's units (no root; b2 = all 256), the frozen layer 608/4
  // kept and 608 gathered.
  EXPECT_DOUBLE_EQ(t.weights, 4 * 168 + 4 * 256 + 4 * 608 / 4.0 + 4 * 608);
  EXPECT_DOUBLE_EQ(t.optimizer, 12 * 256 / 4.0);
  // bf16: the frozen base in 2 bytes, the adapter still 4, and A, B cast to bf16 (2 · 256).
  o.elem_bytes = 2;
  o.shard = "none";
  t = train_memory(m, p, 0, 10, 0, o, 0);
  EXPECT_DOUBLE_EQ(t.weights, 2 * 776 + 4 * 256);
  EXPECT_DOUBLE_EQ(t.activations,
                   10 * ((4 * 8 + 4 * 16) * 2 + (8 + 4 + 4 + 8) * 2 + 2 * 4 + (2 + 8) * 10) +
                       10 * 7 * 2 * 2 + 2 * 256);
}

int run(const std::string& cmd, std::string* out) {
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  if (f == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out->append(buf, n);
  const int st = pclose(f);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

// "parameters: N (M train under freeze vision, counted)" of `lvx plan`'s output: {N, M}.
std::pair<int64_t, int64_t> planned_counts(const std::string& out) {
  const std::string key = "parameters: ";
  size_t at = out.rfind(key, 0) == 0 ? 0 : out.find("\n" + key);
  if (at == std::string::npos) return {-1, -1};
  at = out.find(key, at) + key.size();
  const long long n = std::stoll(out.substr(at));
  const size_t open = out.find('(', at);
  return {n, std::stoll(out.substr(open + 1))};
}

// Every shipped model YAML that names its release's config.json is sized exactly: lvx's counts
// (the family's shapes from config.json, nothing downloaded) equal the reference packages' on the
// meta device (tests/reference/param_count_ref.py: transformers' Mllama, Qwen2 and SigLIP;
// open_flamingo's Flamingo over open_clip's ViT-L-14 and transformers' MPT / GPT-NeoX; what a
// release never runs is left out of what a runtime holds: mPLUG-Owl3's last SigLIP layer,
// post-LayerNorm and pooling head, OpenFlamingo's ViT output projection), and a folder holding
// that config.json alone gives the same. Tolerance 0.1 % (measured: equal).
TEST(TrainMemory, CountsFromConfigJsonEqualTheReferencePackages) {
  const std::string lvx = lvx::testing::binary_dir() + "/lvx";
  if (!std::filesystem::exists(lvx)) GTEST_SKIP() << "build the lvx target first";
  const std::string src = lvx::testing::source_dir();
  const std::vector<std::string> names = {
      "llama32_vision_11b", "mplug_owl3_1b",   "mplug_owl3_2b",  "mplug_owl3_7b",
      "openflamingo_3b",    "openflamingo_4b", "openflamingo_9b"};
  // The release folders hold config.json alone: sized before anything else is downloaded. The
  // reference counts all of them in one process (its packages imported once), a line each.
  auto release = [&](const std::string& name) { return src + "/configs/models/releases/" + name; };
  std::string cmd =
      lvx::testing::configured_python() + " " + src + "/tests/reference/param_count_ref.py count";
  for (const std::string& name : names) cmd += " " + release(name) + "/config.json";
  std::string ref;
  ASSERT_EQ(run(cmd, &ref), 0) << ref;
  std::vector<nlohmann::json> counts;
  std::istringstream lines(ref);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("{\"total\"", 0) == 0) counts.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(counts.size(), names.size()) << ref;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    SCOPED_TRACE(name);
    const nlohmann::json& r = counts[i];
    const double held = r["total"].get<double>() - r["unused"].get<double>();
    const double trains = r["total"].get<double>() - r["vision"].get<double>();
    for (const std::string& model : {src + "/configs/models/" + name + ".yaml", release(name)}) {
      std::string out;
      ASSERT_EQ(run(lvx + " plan --model " + model + " --cluster " + src +
                        "/configs/clusters/h100_80g_16.yaml --train --frames 8 --text 64 --nproc 8",
                    &out),
                0)
          << out;
      const auto [total, train] = planned_counts(out);
      std::cout << name << " (" << (model == release(name) ? "config.json alone" : "YAML")
                << "): lvx " << total << " / " << train << " train, reference " << held << " / "
                << trains << "\n";
      EXPECT_NEAR(total, held, 1e-3 * held);
      EXPECT_NEAR(train, trains, 1e-3 * trains);
    }
  }
}

TEST(TrainMemory, PlanMaxFramesSaysWhatFitsFor7B) {
  const std::string lvx = lvx::testing::binary_dir() + "/lvx";
  if (!std::filesystem::exists(lvx)) GTEST_SKIP() << "build the lvx target first";
  const std::string src = lvx::testing::source_dir();
  const std::string json =
      (std::filesystem::temp_directory_path() / "lvx_test_planner_memory.json").string();
  auto plan = [&](const std::string& flags) {
    std::string out;
    EXPECT_EQ(run(lvx + " plan --model " + src + "/configs/models/mplug_owl3_7b.yaml --cluster " +
                      src + "/configs/clusters/a100_80g_16.yaml --train --max-frames " + flags +
                      " --json " + json,
                  &out),
              0)
        << out;
    nlohmann::json j;
    std::ifstream(json) >> j;
    return j;
  };
  // 7.6 B trainable parameters: 16 bytes each replicated (122 GB) cannot fit 80 GB.
  nlohmann::json j = plan("--nproc 16 --shard none");
  EXPECT_FALSE(j["fits"].get<bool>());
  EXPECT_EQ(j["max_frames"].get<int64_t>(), -1);
  EXPECT_GT(j["best"]["max_frames"].get<int64_t>(), 0);
  // With 4 samples per step the optimizer stage keeps a whole fp32 accumulator (4 Ψt = 28 GiB)
  // and does not fit; the gradients stage keeps only its shard; the parameters stage also
  // divides the weights and fits more frames still.
  j = plan("--nproc 16 --grad-accum 4 --recompute --remat --shard optimizer");
  EXPECT_FALSE(j["fits"].get<bool>());
  j = plan("--nproc 16 --grad-accum 4 --recompute --remat --shard gradients");
  EXPECT_TRUE(j["fits"].get<bool>());
  const int64_t stage2 = j["max_frames"].get<int64_t>();
  EXPECT_GT(stage2, 1000);
  j = plan("--nproc 16 --grad-accum 4 --recompute --remat --shard parameters");
  const int64_t stage3 = j["max_frames"].get<int64_t>();
  EXPECT_GT(stage3, stage2);
  // The default reserve keeps 1.5 GiB + 8 % of the 80 GiB device free (7.9 GiB); without it
  // the peak may fill the device to the byte, so more frames "fit".
  const double gib = double(int64_t{1} << 30);
  EXPECT_NEAR(j["reserve_bytes"].get<double>(), 1.5 * gib + 0.08 * 80 * gib, 1e6);
  j = plan(
      "--nproc 16 --grad-accum 4 --recompute --remat --shard parameters "
      "--memory-reserve-gib 0");
  EXPECT_EQ(j["reserve_bytes"].get<double>(), 0);
  EXPECT_GT(j["max_frames"].get<int64_t>(), stage3);
}

}  // namespace
