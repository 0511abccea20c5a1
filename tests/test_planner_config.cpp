// Config loading: every shipped YAML loads with the shapes of its source, and a missing or unknown
// field is an error naming the file and the field path.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "src/common/error.h"
#include "src/planner/cluster_config.h"
#include "src/planner/model_yaml.h"
#include "tests/build_paths.h"

namespace lvx::planner {
namespace {

namespace fs = std::filesystem;

std::string source(const std::string& rel) { return lvx::testing::source_dir() + "/" + rel; }

std::string write_temp(const std::string& name, const std::string& text) {
  fs::path p = fs::temp_directory_path() / ("lvx_test_planner_" + name);
  std::ofstream(p) << text;
  return p.string();
}

// Expects load() to throw an lvx::Error whose message contains every fragment.
template <typename F>
void expect_error(F load, const std::vector<std::string>& fragments) {
  try {
    load();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    for (const auto& f : fragments)
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

TEST(PlannerConfig, EveryShippedModelLoads) {
  int n = 0;
  for (const auto& entry : fs::directory_iterator(source("configs/models"))) {
    if (entry.path().extension() != ".yaml") continue;  // releases/: config.json folders
    SCOPED_TRACE(entry.path().string());
    ModelConfig m = load_model_config(entry.path().string());
    if (!m.config_json.empty()) {
      EXPECT_TRUE(fs::is_regular_file(m.config_json)) << m.config_json;
    }
    EXPECT_EQ(m.name + ".yaml", entry.path().filename().string());
    EXPECT_GT(m.count(LayerKind::kCross), 0);
    ++n;
  }
  EXPECT_GE(n, 7);
}

TEST(PlannerConfig, EveryShippedClusterLoads) {
  int n = 0;
  for (const auto& entry : fs::directory_iterator(source("configs/clusters"))) {
    SCOPED_TRACE(entry.path().string());
    ClusterConfig c = load_cluster_config(entry.path().string());
    EXPECT_EQ(c.name + ".yaml", entry.path().filename().string());
    EXPECT_GT(c.attention_for("bf16").forward_flops, 0);
    ++n;
  }
  EXPECT_GE(n, 5);
}

// Shapes from ../shared/reference/models.md §1.1, §2.1 and LV-XAttn Table 2 (CA layers, blocks).
TEST(PlannerConfig, ModelShapesMatchTheirSources) {
  struct Expect {
    const char* name;
    int64_t cross, self, heads, kv_heads, head_dim, tokens_per_frame;
  };
  for (const Expect& e : {Expect{"mplug_owl3_7b", 4, 28, 28, 4, 128, 729},
                          Expect{"mplug_owl3_2b", 4, 28, 12, 2, 128, 729},
                          Expect{"mplug_owl3_1b", 4, 24, 14, 2, 64, 729},
                          Expect{"openflamingo_9b", 8, 32, 32, 32, 128, 64},
                          Expect{"openflamingo_4b", 16, 32, 32, 32, 80, 64},
                          Expect{"openflamingo_3b", 24, 24, 16, 16, 128, 64}}) {
    SCOPED_TRACE(e.name);
    ModelConfig m = load_model_config(source(std::string("configs/models/") + e.name + ".yaml"));
    EXPECT_EQ(m.count(LayerKind::kCross), e.cross);
    EXPECT_EQ(m.count(LayerKind::kSelf), e.self);
    EXPECT_EQ(m.visual_tokens_per_frame, e.tokens_per_frame);
    for (const auto& l : m.layers) {
      if (l.kind == LayerKind::kSelf) {
        EXPECT_EQ(l.heads, e.heads);
        EXPECT_EQ(l.kv_heads, e.kv_heads);
        EXPECT_EQ(l.head_dim, e.head_dim);
        EXPECT_EQ(l.mask, MaskRule::kCausal);
      } else {
        EXPECT_TRUE(l.mask == MaskRule::kMediaUpTo || l.mask == MaskRule::kMediaImmediate);
      }
    }
  }
  // mPLUG-Owl3-7B hyper layers 0, 8, 16, 24: the cross layer follows the block's self layer.
  ModelConfig m = load_model_config(source("configs/models/mplug_owl3_7b.yaml"));
  std::vector<int> self_before_cross;
  int selfs = 0;
  for (const auto& l : m.layers) {
    if (l.kind == LayerKind::kSelf)
      ++selfs;
    else
      self_before_cross.push_back(selfs - 1);
  }
  EXPECT_EQ(self_before_cross, (std::vector<int>{0, 8, 16, 24}));
}

const char* kModel = R"(name: t
family: tiny
dtype: fp32
visual_tokens_per_frame: 4
visual_feature_dim: 8
vision_encoder: {hidden_size: 8, layers: 1, heads: 1, mlp_size: 8, image_size: 8, patch_size: 4}
layers:
  - {kind: self, hidden_size: 8, heads: 2, kv_heads: 1, head_dim: 4, mlp_size: 8, mask: causal}
  - {kind: cross, hidden_size: 8, heads: 2, kv_heads: 1, head_dim: 4, mlp_size: 8, mask: media_upto, repeat: 3}
)";

TEST(PlannerConfig, RepeatExpandsLayers) {
  ModelConfig m = load_model_config(write_temp("ok.yaml", kModel));
  EXPECT_EQ(m.layers.size(), 4u);
  EXPECT_EQ(m.count(LayerKind::kCross), 3);
}

std::string replace(std::string s, const std::string& from, const std::string& to) {
  size_t pos = s.find(from);
  EXPECT_NE(pos, std::string::npos) << from;
  return s.replace(pos, from.size(), to);
}

TEST(PlannerConfig, MissingFieldNamesFileAndPath) {
  std::string p = write_temp(
      "missing.yaml",
      replace(kModel, "heads: 2, kv_heads: 1, head_dim: 4, mlp_size: 8, mask: media_upto",
              "kv_heads: 1, head_dim: 4, mlp_size: 8, mask: media_upto"));
  expect_error([&] { load_model_config(p); }, {p, "layers[1].heads: missing"});
  p = write_temp("missing2.yaml", replace(kModel, "visual_feature_dim: 8\n", ""));
  expect_error([&] { load_model_config(p); }, {p, "visual_feature_dim: missing"});
}

TEST(PlannerConfig, UnknownFieldNamesFileAndPath) {
  std::string p =
      write_temp("unknown.yaml", replace(kModel, "mask: causal}", "mask: causal, window: 4}"));
  expect_error([&] { load_model_config(p); }, {p, "layers[0].window: unknown field"});
  p = write_temp("unknown2.yaml", replace(kModel, "patch_size: 4}", "patch_size: 4, dropout: 1}"));
  expect_error([&] { load_model_config(p); }, {p, "vision_encoder.dropout: unknown field"});
  p = write_temp("unknown3.yaml", std::string(kModel) + "extra: 1\n");
  expect_error([&] { load_model_config(p); }, {p, "extra: unknown field"});
}

TEST(PlannerConfig, BadValuesAreNamed) {
  std::string p = write_temp(
      "bad.yaml", replace(kModel, "heads: 2, kv_heads: 1, head_dim: 4, mlp_size: 8, mask: causal",
                          "heads: 3, kv_heads: 2, head_dim: 4, mlp_size: 8, mask: causal"));
  expect_error([&] { load_model_config(p); }, {"layers[0].kv_heads", "multiple"});
  p = write_temp("bad2.yaml", replace(kModel, "mask: causal", "mask: media_upto"));
  expect_error([&] { load_model_config(p); }, {"layers[0].mask", "self-attention"});
  p = write_temp("bad3.yaml", replace(kModel, "head_dim: 4, mlp_size: 8, mask: causal",
                                      "head_dim: four, mlp_size: 8, mask: causal"));
  expect_error([&] { load_model_config(p); }, {"layers[0].head_dim", "integer"});
  expect_error([&] { load_model_config("/nonexistent/m.yaml"); },
               {"/nonexistent/m.yaml", "cannot open"});
}

TEST(PlannerConfig, ClusterErrorsNameTheField) {
  std::string text;
  {
    std::ifstream f(source("configs/clusters/a100_80g_16.yaml"));
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  std::string p =
      write_temp("c1.yaml", replace(text, "inter_node: {bandwidth_gb_per_s: 25, latency_us: 20}",
                                    "inter_node: {bandwidth_gb_per_s: 25}"));
  expect_error([&] { load_cluster_config(p); }, {p, "inter_node.latency_us: missing"});
  p = write_temp(
      "c2.yaml",
      replace(text, "  fp32: {forward: 12, backward: 9}\n",
              "  fp32: {forward: 12, backward: 9}\n  int8: {forward: 1, backward: 1}\n"));
  expect_error([&] { load_cluster_config(p); }, {p, "attention_tflops.int8: unknown field"});
  p = write_temp("c3.yaml", replace(text, "nodes: 4", "nodes: 0"));
  expect_error([&] { load_cluster_config(p); }, {p, "nodes: expected > 0"});
  ClusterConfig c = load_cluster_config(source("configs/clusters/a100_80g_16.yaml"));
  c.attention.erase("fp32");
  expect_error([&] { c.attention_for("fp32"); }, {"attention_tflops.fp32: missing"});
}

TEST(PlannerConfig, CalibrateOutputRoundTrips) {
  ClusterConfig c = load_cluster_config(source("configs/clusters/a100_40g_12.yaml"));
  std::string p = write_temp("rt.yaml", cluster_config_yaml(c, "written by the test\nsecond line"));
  ClusterConfig d = load_cluster_config(p);
  EXPECT_EQ(d.name, c.name);
  EXPECT_EQ(d.gpus_per_node, 3);
  EXPECT_EQ(d.nodes, 4);
  EXPECT_NEAR(d.device_memory_bytes, c.device_memory_bytes, 1 << 20);
  EXPECT_NEAR(d.attention_for("bf16").forward_flops, 180e12, 1e9);
  EXPECT_NEAR(d.intra_node.bandwidth_bytes_per_s, 64e9, 1e5);
  EXPECT_NEAR(d.inter_node.latency_s, 20e-6, 1e-10);
  EXPECT_TRUE(d.cpu_attention.empty());
  // The memory's bandwidth (the data sheet's 1,555 GB/s here) and whether the node shares it.
  EXPECT_NEAR(d.memory.bandwidth_bytes_per_s, 1555e9, 1e5);
  EXPECT_FALSE(d.memory.shared);
  c.memory = {30e9, true};
  d = load_cluster_config(write_temp("rt_mem.yaml", cluster_config_yaml(c, "cpu host")));
  EXPECT_NEAR(d.memory.bandwidth_bytes_per_s, 30e9, 1e3);
  EXPECT_TRUE(d.memory.shared);
  c.memory = {};
  d = load_cluster_config(write_temp("rt_nomem.yaml", cluster_config_yaml(c, "none")));
  EXPECT_EQ(d.memory.bandwidth_bytes_per_s, 0);  // optional: no price, no error
  // calibrate's per-shape CPU path choice survives the round trip; a bad path is named.
  c.cpu_attention = {{1, "fused", 10.5, 25}, {64, "gemm", 30, 20}};
  d = load_cluster_config(write_temp("rt2.yaml", cluster_config_yaml(c, "cpu")));
  ASSERT_EQ(d.cpu_attention.size(), 2u);
  EXPECT_EQ(d.cpu_attention[1].path, "gemm");
  EXPECT_DOUBLE_EQ(d.cpu_attention[1].skv_over_sq, 64);
  EXPECT_DOUBLE_EQ(d.cpu_attention[0].gemm_ms, 25);
  c.cpu_attention = {{8, "magic"}};
  const std::string bad = write_temp("rt3.yaml", cluster_config_yaml(c, "bad"));
  try {
    load_cluster_config(bad);
    ADD_FAILURE() << "a bad cpu_attention path was accepted";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cpu_attention[0].path"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lvx::planner
