// Hostile checkpoints at the unit level (issue 19): the safetensors reader validates the whole
// header before allocating (layout, duplicates, dtypes, shapes, offsets), a checkpoint's integer
// tensors are not weights, its manifest is verified on every load, config.json sizes are checked
// before anything is sized from them, and hidden_act is honoured (not silently SiLU). The same
// files through the CLI: tests/hostile/cases_checkpoint.py.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "models/checkpoint.h"
#include "models/init.h"
#include "models/model.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "tests/model_conformance.h"

namespace lvx::models {
namespace {

namespace fs = std::filesystem;
using lvx::testing::workdir;

std::string path_for(const std::string& name) { return (workdir() / name).string(); }

// A safetensors file from a raw header text and data bytes (no validation: the reader's job).
std::string write_raw(const std::string& name, const std::string& header, const std::string& data) {
  const std::string p = path_for(name);
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  const uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << data;
  return p;
}

std::string bytes(size_t n) { return std::string(n, '\x01'); }

// The error message of load_safetensors(path), or "" when it loads.
std::string load_error(const std::string& path) {
  try {
    load_safetensors(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, AWrittenFileReadsBack) {
  const std::string p = path_for("ok.safetensors");
  save_safetensors(p, {{"a", at::arange(6, at::kFloat).view({2, 3})}, {"b", at::ones({0})}},
                   {{"k", "v"}});
  const TensorFile f = load_safetensors(p);
  EXPECT_TRUE(f.tensors.at("a").equal(at::arange(6, at::kFloat).view({2, 3})));
  EXPECT_EQ(f.tensors.at("b").numel(), 0);
  EXPECT_EQ(f.metadata.at("k"), "v");
}

TEST(Safetensors, RefusesEveryMalformedHeaderNamingTheProblem) {
  const std::string e8 = R"("dtype": "F32", "shape": [2], "data_offsets": )";
  struct Bad {
    std::string name, header, data, expect;
  };
  const std::vector<Bad> cases = {
      {"overlap", R"({"a": {)" + e8 + R"([0, 8]}, "b": {)" + e8 + R"([4, 12]}})", bytes(12),
       "tensors 'a' and 'b' overlap"},
      {"alias", R"({"a": {)" + e8 + R"([0, 8]}, "b": {)" + e8 + R"([0, 8]}})", bytes(8),
       "tensors 'a' and 'b' overlap"},
      {"gap", R"({"a": {)" + e8 + R"([0, 8]}, "b": {)" + e8 + R"([12, 20]}})", bytes(20),
       "begins at byte 12"},
      {"trailing", R"({"a": {)" + e8 + R"([0, 8]}})", bytes(9), "1 bytes after the last tensor"},
      {"past_end", R"({"a": {)" + e8 + R"([0, 8]}})", bytes(7), "holds only 7 data bytes"},
      {"wrapped", R"({"a": {)" + e8 + R"([8, 0]}})", bytes(8), "end before they begin"},
      {"span", R"({"a": {)" + e8 + R"([0, 4]}})", bytes(4), "hold 4 bytes but its shape"},
      {"duplicate", R"({"a": {)" + e8 + R"([0, 8]}, "a": {)" + e8 + R"([8, 16]}})", bytes(16),
       "names 'a' twice"},
      {"dup_field",
       R"({"a": {"dtype": "F32", "dtype": "I32", "shape": [2], "data_offsets": [0, 8]}})", bytes(8),
       "names 'dtype' twice"},
      {"dtype", R"({"a": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})", bytes(2),
       "dtype 'F8_E4M3' is not supported"},
      {"negative", R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", bytes(8),
       "expected non-negative integers"},
      {"fraction", R"({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", bytes(8),
       "expected non-negative integers"},
      {"overflow",
       R"({"a": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 0]}})", "",
       "is too large"},
      {"no_offsets", R"({"a": {"dtype": "F32", "shape": [2]}})", bytes(8), "data_offsets"},
      {"entry_not_object", R"({"a": 3})", "", "expected an object"},
      {"not_object", R"([1, 2])", "", "not a JSON object"},
      {"not_json", R"({"a": )", "", "not valid JSON"},
      {"deep", std::string(200, '[') + std::string(200, ']'), "", "not a JSON object"},
      {"deep_object",
       "{" +
           [] {
             std::string s;
             for (int i = 0; i < 100; ++i) s += "\"a\": {";
             return s + std::string(100, '}');
           }() +
           "}",
       "", "nested deeper than 64"},
  };
  for (const Bad& b : cases) {
    const std::string p = write_raw("bad_" + b.name + ".safetensors", b.header, b.data);
    const std::string msg = load_error(p);
    EXPECT_NE(msg.find(b.expect), std::string::npos) << b.name << ": " << msg;
    EXPECT_NE(msg.find(p), std::string::npos) << b.name << " does not name the file: " << msg;
  }
}

TEST(Safetensors, RefusesLengthLiesAndFilesThatAreNotRegular) {
  const std::string p = path_for("lie.safetensors");
  save_safetensors(p, {{"a", at::ones({4})}});
  std::string raw;
  {
    std::ifstream f(p, std::ios::binary);
    raw.assign(std::istreambuf_iterator<char>(f), {});
  }
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  for (uint64_t lie : {n - 1, n + 1, uint64_t{1} << 40, ~uint64_t{0}}) {
    std::string r = raw;
    std::memcpy(r.data(), &lie, 8);
    std::ofstream(p, std::ios::binary | std::ios::trunc) << r;
    EXPECT_FALSE(load_error(p).empty()) << "header length " << lie << " of " << n;
  }
  EXPECT_NE(load_error(workdir().string()).find("directory"), std::string::npos);
  const std::string fifo = path_for("fifo.safetensors");
  fs::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(load_error(fifo).find("FIFO"), std::string::npos);  // refused, not a hang
  EXPECT_NE(load_error(path_for("missing.safetensors")).find("cannot open (No such file"),
            std::string::npos);
}

TEST(Checkpoint, IntegerTensorsAreNotWeights) {
  const StateDict all{{"w", at::ones({2, 2}, at::kInt)}, {"b", at::ones({2})}};
  try {
    select_parameters(all, {{"w", {2, 2}}, {"b", {2}}}, {}, at::kFloat, "DIR");
    FAIL() << "an int32 weight was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not floating-point"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("w Int"), std::string::npos) << e.what();
  }
}

std::string tiny(const std::string& name) {
  const std::string dir = path_for(name);
  fs::remove_all(dir);
  TinyModelSpec spec;
  write_tiny_mplug_owl3(dir, spec);
  return dir;
}

void edit_config(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json c = read_json_file(dir + "/config.json", "config");
  edit(c);
  std::ofstream(dir + "/config.json") << c.dump(2);
}

std::string load_model_error(const std::string& dir) {
  try {
    load_model(dir, at::kFloat);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Checkpoint, ManifestIsVerifiedOnEveryLoad) {
  const std::string dir = tiny("manifest");
  nlohmann::json files = nlohmann::json::object();
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"})
    files[f] = {{"bytes", fs::file_size(dir + "/" + f)}, {"xxh3", file_xxh3(dir + "/" + f)}};
  std::ofstream(dir + "/manifest.json") << nlohmann::json{{"files", files}}.dump();
  ASSERT_EQ(load_model_error(dir), "");
  {  // one flipped bit in the last weight byte
    std::fstream f(dir + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(c ^ 1));
  }
  const std::string msg = load_model_error(dir);
  EXPECT_NE(msg.find("corrupt checkpoint: model.safetensors has xxh3 checksum"), std::string::npos)
      << msg;
}

TEST(Checkpoint, ConfigSizesAreCheckedBeforeAnythingIsSized) {
  struct Bad {
    std::function<void(nlohmann::json&)> edit;
    std::string expect;
  };
  const std::vector<Bad> cases = {
      {[](auto& c) { c["num_attention_heads"] = 0; }, "num_attention_heads: expected an integer"},
      {[](auto& c) { c["num_key_value_heads"] = 3; }, "must be a multiple of num_key_value_heads"},
      {[](auto& c) { c["num_hidden_layers"] = 1000000000; }, "got 1000000000"},
      {[](auto& c) { c["vocab_size"] = 1000000000000; }, "vocab_size: expected an integer"},
      {[](auto& c) { c["hidden_size"] = -64; }, "hidden_size: expected an integer"},
      {[](auto& c) { c["rms_norm_eps"] = 0; }, "rms_norm_eps: expected a positive number"},
      {[](auto& c) { c["rope_theta"] = -1; }, "rope_theta: expected a positive number"},
      {[](auto& c) { c["hidden_act"] = "tanh9"; }, "activation 'tanh9' is not supported"},
      {[](auto& c) { c["head_dim"] = 15; }, "must be even"},
      {[](auto& c) { c["vision_config"]["patch_size"] = 0; }, "patch_size: expected an integer"},
      {[](auto& c) { c["vision_config"]["num_attention_heads"] = 0; },
       "num_attention_heads: expected an integer"},
      {[](auto& c) { c["vision_config"]["image_size"] = 31623; },
       "image_size: expected an integer"},
      {[](auto& c) { c["vision_config"]["hidden_act"] = 1; }, "hidden_act: expected a string"},
      {[](auto& c) { c["vision_config"]["patch_size"] = 64; }, "give no patch"},
  };
  const std::string dir = tiny("config");
  const nlohmann::json good = read_json_file(dir + "/config.json", "config");
  for (size_t i = 0; i < cases.size(); ++i) {
    edit_config(dir, [&](nlohmann::json& c) {
      c = good;
      cases[i].edit(c);
    });
    const std::string msg = load_model_error(dir);
    EXPECT_NE(msg.find(cases[i].expect), std::string::npos) << "case " << i << ": " << msg;
    EXPECT_NE(msg.find("config.json"), std::string::npos) << "case " << i << ": " << msg;
  }
}

TEST(Checkpoint, HiddenActIsHonoured) {
  // Qwen2's MLP gate activation comes from hidden_act: "gelu" must not run as SiLU.
  const std::string dir = tiny("act");
  Parallel par;
  par.pg = dist::ProcessGroup::from_env();
  ModelInputs in;
  in.input_ids = at::arange(1, 9, at::kLong).unsqueeze(0);
  in.pixel_values = at::zeros({0, 3, 32, 32});
  std::map<std::string, at::Tensor> logits;
  for (const std::string act : {"silu", "swish", "gelu", "relu"}) {
    edit_config(dir, [&](nlohmann::json& c) { c["hidden_act"] = act; });
    logits[act] = load_model(dir, at::kFloat)->forward(in, par).logits;
  }
  EXPECT_TRUE(logits["swish"].equal(logits["silu"]));  // one function, two names
  EXPECT_GT((logits["gelu"] - logits["silu"]).abs().max().item<double>(), 1e-3);
  EXPECT_GT((logits["relu"] - logits["gelu"]).abs().max().item<double>(), 1e-3);
}

}  // namespace
}  // namespace lvx::models
