// LoRA (models/lora.h) against the `peft` package from PyPI (tests/reference/lora_ref.py, peft
// 0.17.1 on transformers' Qwen2 language model of a tiny mPLUG-Owl3 reference checkpoint, under
// the checkpoint's own module names), fp32, on batches without images (lvx's mPLUG-Owl3 with no
// image equals Qwen2: mplug_owl3_ref.py checks it):
//   - an adapter PEFT saved: lvx forward --adapter gives PEFT's logits, loss and lora_A/lora_B
//     gradients; plain LoRA on 7 module kinds and rsLoRA on two;
//   - lvx merge-adapter writes weights transformers loads with the same logits;
//   - lvx finetune with a lora: section trains only the adapter and writes PEFT's layout, which
//     PeftModel.from_pretrained places (every pair) and which gives lvx's logits; --resume
//     continues bitwise; lvx qa --adapter answers as the merged checkpoint does;
//   - OpenFlamingo (the open_flamingo package's Flamingo, LLaMA decoder, batches WITH images): a
//     PEFT adapter on the resampler, the gated cross-attention blocks and the decoder gives PEFT's
//     logits, loss and gradients in lvx; an all-linear lvx finetune writes an adapter PEFT places
//     completely, with lvx's logits;
//   - an adapter on every linear of each family applied on the activation path gives the logits
//     of its merged weights (no linear bypasses the branch);
//   - target selection, the config section, and what is refused.
// Tolerances: logits and loss within 1e-4 absolute (outputs are O(1–10); measured ≈3e-6: lvx
// computes x·Wᵀ + s·(x·Aᵀ)·Bᵀ as PEFT does, on ATen's CPU GEMMs rather than PyTorch's), gradients
// within 1e-4 of their largest element (measured ≈2e-6). The adapters move the logits by O(1)
// (checked), so a LoRA that was not applied cannot pass.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "models/lora.h"
#include "models/model.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
#include "src/runtime/train_config.h"
#include "tests/build_paths.h"
#include "tests/model_conformance.h"

namespace {

using namespace lvx::testing;
namespace fs = std::filesystem;
using nlohmann::json;

const std::string kModules = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";

std::string lora_script() { return lvx::testing::source_dir() + "/tests/reference/lora_ref.py"; }
std::string owl_script() {
  return lvx::testing::source_dir() + "/tests/reference/mplug_owl3_ref.py";
}

// The tiny model, a text-only batch, two PEFT adapters and PEFT's outputs, made once per version
// of the scripts (generated(): the test-reference cache).
struct Made {
  std::string dir, model, batch;
};
const Made& made() {
  static const Made m = [] {
    std::string log;
    const std::string py = python() + " ";
    const std::string d = generated(
        "lora_peft", script_stamp(owl_script()) + read_text(lora_script()),
        [&](const std::string& o) {
          const std::string model = o + "/model", batch = o + "/batch.safetensors";
          std::string out =
              run_command(py + owl_script() + " make-model " + model + " --variant 240728");
          out += run_command(py + owl_script() + " make-batch " + model + " " + batch +
                             " --images-per-sample 0 --length 24");
          out += run_command(py + lora_script() + " logits " + model + " " + batch + " " + o +
                             "/base.safetensors");
          out += run_command(py + lora_script() + " make-adapter " + model + " " + o +
                             "/ad_all --r 4 --alpha 8 --seed 1 --targets " + kModules);
          out += run_command(py + lora_script() + " logits " + model + " " + batch + " " + o +
                             "/peft_all.safetensors --backward --adapter " + o + "/ad_all");
          out += run_command(py + lora_script() + " make-adapter " + model + " " + o +
                             "/ad_rs --r 2 --alpha 4 --rslora --seed 2 --targets q_proj,v_proj");
          out += run_command(py + lora_script() + " logits " + model + " " + batch + " " + o +
                             "/peft_rs.safetensors --adapter " + o + "/ad_rs");
          out += run_command(py + lora_script() + " make-adapter " + model + " " + o +
                             "/ad_head --r 2 --alpha 4 --seed 4 --targets lm_head,v_proj");
          out += run_command(py + lora_script() + " logits " + model + " " + batch + " " + o +
                             "/peft_head.safetensors --backward --adapter " + o + "/ad_head");
          return out;
        },
        &log);
    EXPECT_FALSE(d.empty()) << log;
    return Made{d, d + "/model", d + "/batch.safetensors"};
  }();
  return m;
}

// The same for OpenFlamingo (the open_flamingo package's Flamingo, LLaMA decoder; a batch with
// images): a PEFT adapter on the resampler, the gated cross-attention blocks and the decoder
// (generated(): the test-reference cache).
const Made& made_flamingo() {
  static const Made m = [] {
    const std::string of = lvx::testing::source_dir() + "/tests/reference/openflamingo_ref.py";
    const std::string py = python() + " ";
    std::string log;
    const std::string d = generated(
        "lora_peft_flamingo",
        script_stamp(of) + read_text(lora_script()) +
            read_text(lvx::testing::source_dir() + "/models/openflamingo/convert_openflamingo.py"),
        [&](const std::string& o) {
          const std::string model = o + "/model", batch = o + "/batch.safetensors";
          const std::string ref = py + lora_script() + " ";
          std::string out = run_command(py + of + " make-model " + model + " --lm llama");
          out += run_command(py + of + " make-batch " + model + " " + batch);
          out += run_command(ref + "logits --family openflamingo " + model + " " + batch + " " + o +
                             "/base.safetensors");
          out += run_command(ref + "make-adapter --family openflamingo " + model + " " + o +
                             "/ad --r 2 --alpha 4 --seed 3 --targets "
                             "to_q,to_kv,to_out,q_proj,v_proj,down_proj");
          out += run_command(ref + "logits --family openflamingo " + model + " " + batch + " " + o +
                             "/peft.safetensors --backward --adapter " + o + "/ad");
          return out;
        },
        &log);
    EXPECT_FALSE(d.empty()) << log;
    return Made{d, d + "/model", d + "/batch.safetensors"};
  }();
  return m;
}

std::map<std::string, at::Tensor> tensors(const std::string& path) {
  return lvx::load_safetensors(path).tensors;
}

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// lvx forward on the text batch (or `batch`); returns its output file ("" on failure, with the
// log).
std::string lvx_forward(const std::string& model, const std::string& tag, const std::string& flags,
                        const std::string& batch = "") {
  const std::string out = (workdir() / ("lora_" + tag + ".safetensors")).string();
  fs::remove(out);
  const std::string log =
      run_command(lvx_binary() + " forward --model " + model + " --input " +
                  (batch.empty() ? made().batch : batch) + " --output " + out + " " + flags);
  EXPECT_TRUE(fs::exists(out)) << log;
  return fs::exists(out) ? out : "";
}

TEST(Lora, PeftAdapterGivesPeftsLogitsLossAndGradients) {
  const Made& m = made();
  const std::string out = lvx_forward(m.model, "all", "--backward --adapter " + m.dir + "/ad_all");
  ASSERT_FALSE(out.empty());
  auto got = tensors(out), want = tensors(m.dir + "/peft_all.safetensors"),
       base = tensors(m.dir + "/base.safetensors");
  EXPECT_GT(max_abs(want.at("logits"), base.at("logits")), 0.5) << "the adapter must matter";
  const double e = max_abs(got.at("logits"), want.at("logits"));
  EXPECT_LE(e, 1e-4);
  EXPECT_LE(max_abs(got.at("loss"), want.at("loss")), 1e-4);
  size_t grads = 0;
  double worst = 0;
  for (const auto& [name, g] : want) {
    if (name.rfind("grad.", 0) != 0) continue;
    ASSERT_TRUE(got.count(name)) << name << ": lvx gave no gradient";
    worst = std::max(worst, max_abs(got.at(name), g) / g.abs().max().item<double>());
    ++grads;
  }
  size_t lvx_grads = 0;
  for (const auto& [name, g] : got) lvx_grads += name.rfind("grad.", 0) == 0;
  EXPECT_EQ(grads, 4u * 7u * 2u);  // 4 layers × 7 modules × (A, B)
  EXPECT_EQ(lvx_grads, grads) << "only the adapter trains";
  EXPECT_LE(worst, 1e-4);
  std::cout << "PEFT adapter (7 modules, r 4): logits " << e << ", gradients " << worst << " ("
            << grads << " tensors)\n";
}

TEST(Lora, PeftAdapterOnOpenFlamingoWithImages) {
  // PEFT saves the gated blocks twice (lang_encoder.gated_cross_attn_layers.i is an alias of
  // lang_encoder.model.layers.i.gated_cross_attn_layer); lvx drops the aliases.
  const Made& m = made_flamingo();
  const std::string out =
      lvx_forward(m.model, "flamingo", "--backward --adapter " + m.dir + "/ad", m.batch);
  ASSERT_FALSE(out.empty());
  auto got = tensors(out), want = tensors(m.dir + "/peft.safetensors");
  EXPECT_GT(max_abs(want.at("logits"), tensors(m.dir + "/base.safetensors").at("logits")), 0.5);
  const double e = max_abs(got.at("logits"), want.at("logits"));
  EXPECT_LE(e, 1e-4);
  EXPECT_LE(max_abs(got.at("loss"), want.at("loss")), 1e-4);
  size_t grads = 0, lvx_grads = 0;
  double worst = 0;
  for (const auto& [name, g] : want) {
    if (name.rfind("grad.", 0) != 0) continue;
    ASSERT_TRUE(got.count(name)) << name << ": lvx gave no gradient";
    worst = std::max(worst, max_abs(got.at(name), g) / g.abs().max().item<double>());
    ++grads;
  }
  for (const auto& [name, g] : got) lvx_grads += name.rfind("grad.", 0) == 0;
  bool gated = false, perceiver = false;
  for (const auto& [name, g] : want) {
    gated = gated || name.find(".gated_cross_attn_layer.attn.to_kv.lora_A") != std::string::npos;
    perceiver = perceiver || name.rfind("grad.perceiver.", 0) == 0;
  }
  EXPECT_TRUE(gated && perceiver);
  EXPECT_EQ(lvx_grads, grads);
  EXPECT_GE(grads, 40u);
  EXPECT_LE(worst, 1e-4);
  std::cout << "PEFT adapter on OpenFlamingo (resampler, gated blocks, decoder): logits " << e
            << ", gradients " << worst << " (" << grads << " tensors)\n";
}

// Every linear of every family goes through the LoRA branch (models::linear): an adapter on
// EVERY linear weight of the language model (and OpenFlamingo's resampler), applied on the
// activation path (lvx forward --adapter), gives the logits of its merged weights W + s·B·A
// (lvx merge-adapter, then lvx forward). A linear that skipped the branch leaves its adapter
// out of the first and not of the second: the adapters move the logits by O(1) (checked), the
// tolerance is 1e-4 (fp32, the two sum in different orders; measured below 1e-5).
TEST(Lora, ActivationPathEqualsMergedWeightsInEveryFamily) {
  const Reference mllama =
      reference_model("mllama", lvx::testing::source_dir() + "/tests/reference/mllama_ref.py",
                      script_stamp(lvx::testing::source_dir() + "/tests/reference/mllama_ref.py"),
                      "", "--length 24");
  struct Case {
    std::string family, model, batch, under;
  };
  const std::vector<Case> cases{
      {"mplug_owl3", made().model, made().batch, "language_model."},
      {"openflamingo", made_flamingo().model, made_flamingo().batch, "lang_encoder.,perceiver."},
      {"mllama", mllama.model, mllama.batch, "language_model."}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.family);
    const fs::path d = workdir() / ("lora_every_linear_" + c.family);
    fs::remove_all(d);
    const std::string ad = (d / "ad").string(), merged = (d / "merged").string();
    const std::string log = run_command(python() + " " + lora_script() + " random-adapter " +
                                        c.model + " " + ad + " --under " + c.under + " --seed 7");
    ASSERT_TRUE(fs::exists(ad + "/adapter_model.safetensors")) << log;
    const std::string mlog = run_command(lvx_binary() + " merge-adapter --model " + c.model +
                                         " --adapter " + ad + " --output " + merged);
    ASSERT_TRUE(fs::exists(merged + "/config.json")) << mlog;
    const std::string on_path =
        lvx_forward(c.model, c.family + "_path", "--adapter " + ad, c.batch);
    const std::string on_merged = lvx_forward(merged, c.family + "_merged", "", c.batch);
    const std::string base = lvx_forward(c.model, c.family + "_base", "", c.batch);
    ASSERT_FALSE(on_path.empty() || on_merged.empty() || base.empty());
    const at::Tensor got = tensors(on_path).at("logits"), want = tensors(on_merged).at("logits");
    EXPECT_GT(max_abs(want, tensors(base).at("logits")), 0.5) << "the adapter must matter";
    const double e = max_abs(got, want);
    EXPECT_LE(e, 1e-4);
    std::cout << c.family << ": LoRA on every linear, activation path vs merged weights: " << e
              << "\n";
  }
}

TEST(Lora, RsLoraAdapterOnTwoModules) {
  const Made& m = made();
  const std::string out = lvx_forward(m.model, "rs", "--adapter " + m.dir + "/ad_rs");
  ASSERT_FALSE(out.empty());
  auto want = tensors(m.dir + "/peft_rs.safetensors");
  EXPECT_GT(max_abs(want.at("logits"), tensors(m.dir + "/base.safetensors").at("logits")), 0.1);
  EXPECT_LE(max_abs(tensors(out).at("logits"), want.at("logits")), 1e-4);
}

// LoRA on the output head (target_modules: [lm_head]) is on the logits' path: its A and B get
// PEFT's gradients (every family computed its logits with a plain product that bypassed the
// branch: the head's adapter trained nothing, and qa --adapter then merged it untrained).
TEST(Lora, LmHeadAdapterGetsPeftsGradients) {
  const Made& m = made();
  const std::string out =
      lvx_forward(m.model, "head", "--backward --adapter " + m.dir + "/ad_head");
  ASSERT_FALSE(out.empty());
  auto got = tensors(out), want = tensors(m.dir + "/peft_head.safetensors");
  EXPECT_LE(max_abs(got.at("logits"), want.at("logits")), 1e-4);
  size_t head = 0;
  for (const auto& [name, g] : want) {
    if (name.rfind("grad.", 0) != 0) continue;
    ASSERT_TRUE(got.count(name)) << name << ": lvx gave no gradient";
    EXPECT_LE(max_abs(got.at(name), g) / g.abs().max().item<double>(), 1e-4) << name;
    head += name.find("lm_head.lora_") != std::string::npos;
  }
  EXPECT_EQ(head, 2u) << "PEFT's gradients hold lm_head's A and B";
}

TEST(Lora, MergeAdapterWritesWeightsTransformersLoads) {
  const Made& m = made();
  const std::string merged = (workdir() / "lora_merged").string();
  fs::remove_all(merged);
  const std::string log = run_command(lvx_binary() + " merge-adapter --model " + m.model +
                                      " --adapter " + m.dir + "/ad_all --output " + merged);
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  EXPECT_TRUE(fs::exists(merged + "/tokenizer.json"));
  EXPECT_EQ(read_text(merged + "/config.json"), read_text(m.model + "/config.json"));
  // transformers alone on the merged weights = PEFT on the base weights with the adapter.
  const std::string hf = (workdir() / "lora_merged_hf.safetensors").string();
  const std::string log2 = run_command(python() + " " + lora_script() + " merged-logits " + merged +
                                       " " + m.batch + " " + hf);
  ASSERT_TRUE(fs::exists(hf)) << log2;
  EXPECT_LE(
      max_abs(tensors(hf).at("logits"), tensors(m.dir + "/peft_all.safetensors").at("logits")),
      1e-4);
  // lvx on the merged directory; tensors the adapter does not touch are copied bit for bit.
  const std::string out = lvx_forward(merged, "merged", "");
  ASSERT_FALSE(out.empty());
  EXPECT_LE(
      max_abs(tensors(out).at("logits"), tensors(m.dir + "/peft_all.safetensors").at("logits")),
      1e-4);
  const auto a = lvx::load_checkpoint_dir(m.model), b = lvx::load_checkpoint_dir(merged);
  ASSERT_EQ(a.size(), b.size());
  int changed = 0;
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    if (!at::equal(t, b.at(name))) ++changed;
  }
  EXPECT_EQ(changed, 28);  // the adapted weights, and only those
  // Refuses to write into a directory that holds files.
  EXPECT_NE(run_command(lvx_binary() + " merge-adapter --model " + m.model + " --adapter " + m.dir +
                        "/ad_all --output " + merged)
                .find("already exists"),
            std::string::npos);
}

TEST(Lora, AllLinearTargetsTheLanguageModelOnly) {
  auto model = lvx::models::load_model(made().model, at::kFloat);
  lvx::models::LoraConfig c;
  const auto names = lvx::models::lora_targets(*model, c);
  const std::set<std::string> got(names.begin(), names.end());
  // 4 layers × 7 Qwen2 linears, v_kv_proj of the 2 hyper layers, the projector's 2 linears.
  EXPECT_EQ(got.size(), 4u * 7u + 2u + 2u);
  EXPECT_TRUE(got.count("language_model.model.layers.1.self_attn.v_kv_proj.weight"));
  EXPECT_TRUE(got.count("vision2text_model.0.weight"));
  for (const auto& n : got) {
    EXPECT_NE(n.rfind("vision_model.", 0), 0u) << n << ": the vision tower is frozen";
    EXPECT_EQ(n.find("embed_tokens"), std::string::npos) << n;
    EXPECT_EQ(n.find("lm_head"), std::string::npos) << n;
  }
  // A named list follows PEFT's suffix rule: "v_proj" is not "v_kv_proj".
  c.target_modules = {"v_proj"};
  EXPECT_EQ(lvx::models::lora_targets(*model, c).size(), 4u);
  c.target_modules = {"qproj"};
  try {
    lvx::models::lora_targets(*model, c);
    ADD_FAILURE() << "an unknown module must be refused";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'qproj' matches no linear weight"), std::string::npos)
        << e.what();
  }
  // The parameter count: Σ r·(in + out).
  c.target_modules = {"q_proj"};
  c.r = 4;
  const auto ad = lvx::models::init_lora(*model, c, 0, "m");
  EXPECT_EQ(ad.parameters(), 4 * 4 * (64 + 64));
  for (const auto& [n, l] : ad.layers) {
    EXPECT_EQ(l.b.abs().max().item<double>(), 0.0);        // PEFT's init: B = 0
    EXPECT_LE(l.a.abs().max().item<double>(), 1.0 / 8.0);  // U(-1/sqrt(in), 1/sqrt(in)), in 64
  }
}

TEST(Lora, RefusesWhatItCannotApply) {
  auto model = lvx::models::load_model(made().model, at::kFloat);
  const std::string d = (workdir() / "lora_bad").string();
  fs::remove_all(d);
  fs::copy(made().dir + "/ad_rs", d);
  auto expect_error = [&](const std::string& what, const std::string& needle) {
    try {
      lvx::models::load_lora(d, *model);
      ADD_FAILURE() << what << ": accepted";
    } catch (const lvx::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
  };
  json cfg = lvx::read_json_file(d + "/adapter_config.json", "x");
  json dora = cfg;
  dora["use_dora"] = true;
  std::ofstream(d + "/adapter_config.json") << dora.dump();
  expect_error("DoRA", "field 'use_dora'");
  std::ofstream(d + "/adapter_config.json") << cfg.dump();
  // A pair whose shapes do not fit its weight.
  auto t = tensors(d + "/adapter_model.safetensors");
  const std::string key = t.begin()->first;
  t[key] = at::zeros({2, 3});
  lvx::save_safetensors(d + "/adapter_model.safetensors", t);
  expect_error("shape", "do not fit the weight");
  // A module the model does not have.
  t = tensors(made().dir + "/ad_rs/adapter_model.safetensors");
  t["base_model.model.language_model.model.layers.9.self_attn.q_proj.lora_A.weight"] =
      at::zeros({2, 64});
  t["base_model.model.language_model.model.layers.9.self_attn.q_proj.lora_B.weight"] =
      at::zeros({64, 2});
  lvx::save_safetensors(d + "/adapter_model.safetensors", t);
  expect_error("unknown module", "layers.9.self_attn.q_proj");
  // The commands name a directory that is not an adapter before ranks start.
  for (const std::string& cmd :
       {" forward --model " + made().model + " --input " + made().batch + " --output " +
            (workdir() / "lora_never.safetensors").string() + " --adapter " + made().model,
        " qa --model " + made().model + " --video x.mp4 --question q --adapter " + made().model,
        " merge-adapter --model " + made().model + " --adapter " + made().model + " --output " +
            (workdir() / "lora_never").string()}) {
    const std::string log = run_command(lvx_binary() + cmd);
    EXPECT_NE(log.find("exit status"), std::string::npos) << cmd;
    EXPECT_NE(log.find("adapter_config.json"), std::string::npos) << cmd << ": " << log;
  }
  EXPECT_FALSE(fs::exists(workdir() / "lora_never"));
}

TEST(Lora, ConfigSection) {
  const std::string path = (workdir() / "lora_cfg.yaml").string();
  std::ofstream(path) << "model: {path: m}\ndata: {train: t.jsonl, num_frames: 2}\n"
                      << "schedule: {steps: 1}\ncheckpoint: {dir: ck}\n"
                      << "lora: {r: 4, alpha: 16, target_modules: [q_proj, v_proj]}\n";
  const auto c = lvx::runtime::load_train_config(path, {"lora.r=8"});
  EXPECT_EQ(c.lora.r, 8);
  EXPECT_EQ(c.lora.alpha, 16);
  EXPECT_EQ(c.lora.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  const auto back = lvx::runtime::train_config_from_yaml(lvx::runtime::to_yaml(c), "yaml");
  EXPECT_EQ(back.lora.r, 8);
  EXPECT_EQ(back.lora.target_modules, c.lora.target_modules);
  const auto changes = lvx::runtime::config_changes(c, lvx::runtime::load_train_config(path, {}));
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0], "lora.r: 8 -> 4");
  auto fails = [&](const std::vector<std::string>& o, const std::string& needle) {
    try {
      lvx::runtime::load_train_config(path, o);
      ADD_FAILURE() << needle << ": accepted";
    } catch (const lvx::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  fails({"lora.dropout=0.05"}, "lora.dropout: 0.05 is not supported");
  fails({"lora.rank=4"}, "lora.rank: unknown field");
  fails({"lora.target_modules={a: 1}"}, "lora.target_modules");
  // No section: full fine-tuning, and to_yaml does not mention LoRA.
  std::ofstream(path) << "model: {path: m}\ndata: {train: t.jsonl, num_frames: 2}\n"
                      << "schedule: {steps: 1}\ncheckpoint: {dir: ck}\n";
  const auto full = lvx::runtime::load_train_config(path, {});
  EXPECT_EQ(full.lora.r, 0);
  EXPECT_EQ(lvx::runtime::to_yaml(full).find("lora"), std::string::npos);
}

// Videos and a run config for the fine-tuning tests.
std::string finetune_config(const std::string& name, const std::string& ck, int64_t steps,
                            const std::string& model = "",
                            const std::string& lora = "{r: 4, alpha: 8, target_modules: [" +
                                                      kModules + "]}") {
  const fs::path d = workdir() / "lora_ft";
  fs::create_directories(d);
  const std::string video = (d / "testsrc.mp4").string();
  if (!fs::exists(video)) {
    EXPECT_EQ(run_command("ffmpeg -loglevel error -y -f lavfi -i testsrc=size=64x64:rate=4 -t 4 "
                          "-pix_fmt yuv420p " +
                          video),
              "");
  }
  const std::string data = (d / "train.jsonl").string();
  std::ofstream(data) << R"({"video": ")" << video
                      << R"(", "question": "What pattern is shown?", "answer": "color bars"})"
                      << "\n"
                      << R"({"video": ")" << video
                      << R"(", "question": "What moves?", "answer": "shapes", "end": 3.5})"
                      << "\n";
  const std::string path = (d / (name + ".yaml")).string();
  std::ofstream(path) << "model: {path: " << (model.empty() ? made().model : model) << "}\n"
                      << "data: {train: " << data << ", num_frames: 2, seed: 3}\n"
                      << "optimizer: {lr: 2.0e-2}\n"
                      << "schedule: {steps: " << steps << "}\n"
                      << "checkpoint: {dir: " << ck << ", every: 2, keep: 3}\n"
                      << "lora: " << lora << "\n";
  return path;
}

// A fine-tuned LoRA checkpoint holds the adapter in PEFT's files and no weights, and its
// adapter trained: B is no longer zero.
void expect_adapter_checkpoint(const std::string& step) {
  for (const char* f : {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors",
                        "trainer_state.json", "manifest.json"})
    EXPECT_TRUE(fs::exists(step + "/" + f)) << f;
  EXPECT_FALSE(fs::exists(step + "/model.safetensors")) << "a LoRA checkpoint holds no weights";
  const json ac = lvx::read_json_file(step + "/adapter_config.json", "adapter config");
  EXPECT_EQ(ac["peft_type"], "LORA");
  EXPECT_EQ(ac["r"], 4);
  EXPECT_EQ(ac["lora_alpha"], 8.0);
  // SigLIP has q_proj, k_proj and v_proj too, which lvx leaves alone: a list would make PEFT adapt
  // them, so the file names the adapted modules by a regular expression (PEFT places exactly the
  // 28 pairs below).
  EXPECT_TRUE(ac["target_modules"].is_string()) << ac["target_modules"];
  // Only the adapter trained (28 pairs), and it moved: B is no longer zero.
  const auto ad = tensors(step + "/adapter_model.safetensors");
  EXPECT_EQ(ad.size(), 56u);
  double bmax = 0;
  for (const auto& [k, t] : ad)
    if (k.find("lora_B") != std::string::npos) bmax = std::max(bmax, t.abs().max().item<double>());
  EXPECT_GT(bmax, 1e-3);
}

// PEFT places every pair (lora_ref.py checks it) and gives lvx's logits.
void expect_peft_gives_lvx_logits(const Made& m, const std::string& step) {
  const std::string peft = (workdir() / "lora_ft_peft.safetensors").string();
  const std::string log2 = run_command(python() + " " + lora_script() + " logits " + m.model + " " +
                                       m.batch + " " + peft + " --adapter " + step);
  ASSERT_TRUE(fs::exists(peft)) << log2;
  const std::string out = lvx_forward(m.model, "ft", "--adapter " + step);
  ASSERT_FALSE(out.empty());
  const auto want = tensors(peft).at("logits");
  EXPECT_GT(max_abs(want, tensors(m.dir + "/base.safetensors").at("logits")), 1e-3);
  EXPECT_LE(max_abs(tensors(out).at("logits"), want), 1e-4);
}

// Killed (kill -9) as step 3 begins, then --resume from step 2: bitwise the same adapter and
// optimizer state as the uninterrupted run's `step`.
void expect_kill_and_resume_bitwise(const std::string& step) {
  const std::string ck2 = (workdir() / "lora_ft" / "ck2").string();
  fs::remove_all(ck2);
  const std::string cfg2 = finetune_config("resume", ck2, 4);
  EXPECT_NE(run_command("LVX_FAULT_KILL=0@2 " + lvx_faults_binary() + " finetune --config " + cfg2)
                .find("exit status"),
            std::string::npos);
  ASSERT_TRUE(fs::exists(ck2 + "/step-000002/adapter_model.safetensors"));
  ASSERT_FALSE(fs::exists(ck2 + "/step-000004"));
  const std::string log3 = run_command(lvx_binary() + " finetune --config " + cfg2 + " --resume");
  ASSERT_EQ(log3.find("exit status"), std::string::npos) << log3;
  for (const char* f : {"adapter_model.safetensors", "optimizer.safetensors"}) {
    const auto a = tensors(step + "/" + f), b = tensors(ck2 + "/step-000004/" + f);
    ASSERT_EQ(a.size(), b.size()) << f;
    for (const auto& [k, t] : a) EXPECT_TRUE(at::equal(t, b.at(k))) << f << " " << k;
  }
}

// lvx qa --adapter answers as the merged checkpoint does (greedy).
void expect_qa_with_adapter_equals_merged(const Made& m, const std::string& step) {
  const std::string merged = (workdir() / "lora_ft_merged").string();
  fs::remove_all(merged);
  ASSERT_EQ(run_command(lvx_binary() + " merge-adapter --model " + m.model + " --adapter " + step +
                        " --output " + merged)
                .find("exit status"),
            std::string::npos);
  const std::string q = " --video " + (workdir() / "lora_ft" / "testsrc.mp4").string() +
                        " --question 'What pattern is shown?' --num-frames 2 --max-new-tokens 6 "
                        "--json 2>/dev/null";
  auto qa = [](const std::string& cmd) {
    const std::string out = run_command(cmd);
    try {
      return json::parse(out);
    } catch (const std::exception&) {
      ADD_FAILURE() << "not JSON: " << out;
      return json();
    }
  };
  const json a = qa(lvx_binary() + " qa --model " + m.model + " --adapter " + step + q);
  const json b = qa(lvx_binary() + " qa --model " + merged + q);
  EXPECT_TRUE(a.contains("response"));
  EXPECT_EQ(a["response"], b["response"]);
  EXPECT_EQ(a["new_tokens"], b["new_tokens"]);
}

TEST(Lora, FinetuneWritesAnAdapterPeftLoads) {
  const Made& m = made();
  const std::string ck = (workdir() / "lora_ft" / "ck").string();
  fs::remove_all(ck);
  const std::string cfg = finetune_config("run", ck, 4);
  const std::string log = run_command(lvx_binary() + " finetune --config " + cfg);
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  const std::string step = ck + "/step-000004";
  expect_adapter_checkpoint(step);
  expect_peft_gives_lvx_logits(m, step);
  if (HasFatalFailure()) return;  // a failed ASSERT in a step ends the test, as in one body
  expect_kill_and_resume_bitwise(step);
  if (HasFatalFailure()) return;
  expect_qa_with_adapter_equals_merged(m, step);
}

TEST(Lora, AllLinearOnOpenFlamingoWritesAnAdapterPeftLoads) {
  // all-linear: the resampler's and the gated blocks' linears (their FF Sequentials hold
  // LayerNorms beside the Linears) and the decoder's, none of the vision tower; PEFT must place
  // every pair of the file through the regular expression lvx writes, and agree on the logits.
  const Made& m = made_flamingo();
  const std::string ck = (workdir() / "lora_ft" / "ck_flamingo").string();
  fs::remove_all(ck);
  const std::string log = run_command(lvx_binary() + " finetune --config " +
                                      finetune_config("flamingo", ck, 2, m.model, "{r: 2}"));
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  const std::string step = ck + "/step-000002";
  const auto ad = tensors(step + "/adapter_model.safetensors");
  // 4 layers × 7 decoder linears, 2 gated blocks × (to_q, to_kv, to_out, ff.1, ff.3), 2
  // resampler layers × the same five.
  EXPECT_EQ(ad.size(), 2u * (4 * 7 + 2 * 5 + 2 * 5));
  const std::string peft = (workdir() / "lora_ft_flamingo_peft.safetensors").string();
  const std::string log2 =
      run_command(python() + " " + lora_script() + " logits --family openflamingo " + m.model +
                  " " + m.batch + " " + peft + " --adapter " + step);
  ASSERT_TRUE(fs::exists(peft)) << log2;
  const std::string out = lvx_forward(m.model, "ft_flamingo", "--adapter " + step, m.batch);
  ASSERT_FALSE(out.empty());
  const auto want = tensors(peft).at("logits");
  EXPECT_GT(max_abs(want, tensors(m.dir + "/base.safetensors").at("logits")), 1e-3);
  EXPECT_LE(max_abs(tensors(out).at("logits"), want), 1e-4);
}

}  // namespace
