// Tiny random mPLUG-Owl3 checkpoints (models/init.h): the directory loads with load_model and
// runs forward with the images reaching the logits; the same seed writes the same bytes; the
// initialisation follows its documented rules; and the written tokenizer.json is accepted by the
// `tokenizers` package (a tokenizer nobody here wrote), which gives the same ids as lvx's
// Tokenizer on a chat prompt, with every listed word a single token.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "models/init.h"
#include "models/model.h"
#include "models/tokenizer/tokenizer.h"
#include "src/common/error.h"
#include "src/dist/process_group.h"
#include "tests/build_paths.h"
#include "tests/model_conformance.h"

namespace lvx::models {
namespace {

using lvx::testing::run_command;
using lvx::testing::workdir;

const std::vector<std::string> kWords = {"user",    "assistant", "What",   "colour",   "was",
                                         "the",     "shape",     "that",   "appeared", "in",
                                         "video",   "red",       "green",  "blue",     "yellow",
                                         "magenta", "cyan",      "square", "circle",   "triangle"};

const char* const kChat =
    "<|im_start|>user\n<|image|><|image|>What colour was the shape?<|im_end|>\n"
    "<|im_start|>assistant\nred<|im_end|>";

TinyModelSpec tiny_spec(uint64_t seed = 3) {
  TinyModelSpec s;
  s.words = kWords;
  s.seed = seed;
  return s;
}

std::string dir_for(const std::string& name) { return (workdir() / ("init_" + name)).string(); }

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.is_open()) << path;
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

Parallel single_rank() {
  Parallel par;
  par.pg = dist::ProcessGroup::from_env();
  return par;
}

TEST(TinyModelInit, LoadsAndRunsForwardWithTheImagesReachingTheLogits) {
  for (const std::string variant : {"240728", "241101"}) {
    const std::string dir = dir_for("fwd_" + variant);
    TinyModelSpec spec = tiny_spec();
    spec.variant = variant;
    write_tiny_mplug_owl3(dir, spec);
    const auto model = load_model(dir, at::kFloat);
    ASSERT_EQ(model->family().model_type(), "mplugowl3");
    EXPECT_EQ(model->decoder_layers(), 2);
    EXPECT_EQ(model->tokens_per_media(), 16);  // (32 / 8)²
    EXPECT_EQ(model->parameters().count("language_model.model.layers.0.self_attn.gate"),
              variant == "240728" ? 1u : 0u);
    const Tokenizer tok = Tokenizer::from_file(dir + "/tokenizer.json");
    EXPECT_EQ(model->media_token_id(), *tok.token_to_id("<|image|>"));
    const std::vector<int64_t> ids = tok.encode(kChat);
    const int64_t L = static_cast<int64_t>(ids.size());
    ModelInputs in;
    in.input_ids = at::tensor(ids, at::kLong).unsqueeze(0);
    at::manual_seed(0);
    in.pixel_values = at::rand({2, 3, 32, 32}) * 2 - 1;
    const ModelOutputs out = model->forward(in, single_rank());
    ASSERT_EQ(out.logits.sizes(), (std::vector<int64_t>{1, L, tok.vocab_size()}));
    EXPECT_TRUE(at::isfinite(out.logits).all().item<bool>());
    // Unit-scale init: logits neither vanish nor blow up (a std 0.02 init gives ~1e-2 here).
    const double sd = out.logits.std().item<double>();
    EXPECT_GT(sd, 0.2) << variant;
    EXPECT_LT(sd, 10) << variant;
    // Other images change the logits after the images and only there.
    ModelInputs other = in;
    other.pixel_values = -in.pixel_values;
    const at::Tensor diff = (model->forward(other, single_rank()).logits - out.logits).abs();
    int64_t first_image = -1;
    for (int64_t t = 0; t < L && first_image < 0; ++t)
      if (ids[t] == model->media_token_id()) first_image = t;
    ASSERT_GE(first_image, 0);
    EXPECT_EQ(diff.slice(1, 0, first_image).max().item<double>(), 0.0) << variant;
    EXPECT_GT(diff.slice(1, first_image + 2).max().item<double>(), 1e-3) << variant;
  }
}

TEST(TinyModelInit, SameSeedSameBytesOtherSeedOtherWeights) {
  write_tiny_mplug_owl3(dir_for("seed_a"), tiny_spec(11));
  write_tiny_mplug_owl3(dir_for("seed_b"), tiny_spec(11));
  write_tiny_mplug_owl3(dir_for("seed_c"), tiny_spec(12));
  for (const char* f : {"model.safetensors", "config.json", "tokenizer.json"}) {
    const std::string a = slurp(dir_for("seed_a") + "/" + f);
    EXPECT_FALSE(a.empty()) << f;
    EXPECT_EQ(a, slurp(dir_for("seed_b") + "/" + f)) << f;
  }
  EXPECT_NE(slurp(dir_for("seed_a") + "/model.safetensors"),
            slurp(dir_for("seed_c") + "/model.safetensors"));
}

TEST(TinyModelInit, ParametersFollowTheDocumentedRules) {
  write_tiny_mplug_owl3(dir_for("rules"), tiny_spec());
  const Checkpoint ck = load_checkpoint(dir_for("rules"));
  int64_t matrices = 0;
  for (const auto& [name, t] : ck.tensors) {
    ASSERT_EQ(t.scalar_type(), at::kFloat) << name;
    const std::string leaf = name.substr(name.rfind('.') + 1);
    if (leaf == "gate" || leaf == "bias") {
      EXPECT_EQ(t.abs().max().item<double>(), 0.0) << name;
    } else if (name.find("norm") != std::string::npos) {
      EXPECT_TRUE(at::equal(t, at::ones_like(t))) << name;
    } else if (name.find("embed_tokens") != std::string::npos) {
      EXPECT_NEAR(t.std().item<double>(), 1.0, 0.05) << name;
    } else if (name.find("position_embedding") != std::string::npos) {
      EXPECT_NEAR(t.std().item<double>(), 0.02, 0.004) << name;
    } else {
      ASSERT_GE(t.dim(), 2) << name;
      const double want = 1.0 / std::sqrt(static_cast<double>(t.numel() / t.size(0)));
      // Relative sampling error of a std over n >= 1024 normals is ~1/sqrt(2n) <= 2.2 %.
      EXPECT_NEAR(t.std().item<double>() / want, 1.0, 0.1) << name;
      ++matrices;
    }
  }
  EXPECT_GT(matrices, 10);
  EXPECT_EQ(ck.config["hyper_layers"], nlohmann::json::array({1}));
  EXPECT_EQ(ck.config["vision_config"]["num_hidden_layers"], 2);
}

// ids of `text` from the tokenizers package, one line of JSON per text in `texts_file`.
std::vector<std::vector<int64_t>> python_ids(const std::string& tokenizer_json,
                                             const std::vector<std::string>& texts) {
  const std::string in = (workdir() / "init_texts.json").string();
  std::ofstream(in) << nlohmann::json(texts).dump();
  const std::string script =
      "import json, sys\n"
      "from tokenizers import Tokenizer\n"
      "t = Tokenizer.from_file(sys.argv[1])\n"
      "for s in json.load(open(sys.argv[2])):\n"
      "    print(json.dumps(t.encode(s, add_special_tokens=False).ids))\n";
  const std::string py = (workdir() / "init_ids.py").string();
  std::ofstream(py) << script;
  const std::string out =
      run_command(lvx::testing::configured_python() + " " + py + " " + tokenizer_json + " " + in);
  std::vector<std::vector<int64_t>> ids;
  std::istringstream ss(out);
  std::string line;
  while (std::getline(ss, line)) {
    EXPECT_EQ(line.rfind("[", 0), 0u) << out;
    if (line.rfind("[", 0) != 0) return {};
    ids.push_back(nlohmann::json::parse(line).get<std::vector<int64_t>>());
  }
  return ids;
}

TEST(TinyModelInit, TokenizerMatchesTheTokenizersPackageWithEachWordOneToken) {
  const std::string dir = dir_for("tok");
  write_tiny_mplug_owl3(dir, tiny_spec());
  const std::string path = dir + "/tokenizer.json";
  const Tokenizer tok = Tokenizer::from_file(path);
  std::vector<std::string> texts = {kChat, "Ünïcödé, digits 42 and\ttabs: not in the word list!"};
  for (const auto& w : kWords) {
    texts.push_back(w);
    texts.push_back(" " + w);
  }
  const auto py = python_ids(path, texts);
  ASSERT_EQ(py.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int64_t> mine = tok.encode(texts[i]);
    EXPECT_EQ(mine, py[i]) << "'" << texts[i] << "'";
    EXPECT_EQ(tok.decode(mine), texts[i]);
    if (i >= 2) {
      EXPECT_EQ(mine.size(), 1u) << "'" << texts[i] << "' is not one token";
    }
  }
  // The chat prompt: the specials are single tokens and the answer word follows "\n" whole.
  const std::vector<int64_t> chat = tok.encode(kChat);
  const std::vector<std::string> want = {
      "<|im_start|>", "user",         "\n",        "<|image|>", "<|image|>", "What",
      " colour",      " was",         " the",      " shape",    "?",         "<|im_end|>",
      "\n",           "<|im_start|>", "assistant", "\n",        "red",       "<|im_end|>"};
  ASSERT_EQ(chat.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(tok.decode({chat[i]}), want[i]) << i;
}

TEST(TinyModelInit, BadSpecsAreNamed) {
  auto expect_error = [](TinyModelSpec s, const std::string& part) {
    try {
      write_tiny_mplug_owl3(dir_for("bad"), s);
      ADD_FAILURE() << "no error for " << part;
    } catch (const lvx::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  TinyModelSpec s = tiny_spec();
  s.vision_layers = 1;
  expect_error(s, "vision_layers");
  s = tiny_spec();
  s.words.push_back("red2");
  expect_error(s, "'red2'");
  s = tiny_spec();
  s.hyper_layers = {0};  // 0-based by mistake
  expect_error(s, "hyper_layers");
  s = tiny_spec();
  s.variant = "2407";
  expect_error(s, "variant");
}

}  // namespace
}  // namespace lvx::models
