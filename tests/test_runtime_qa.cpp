// lvx qa: prompts against the tokenizers package on the template written out by hand, answer
// extraction as lmms-eval does it, deterministic greedy answers at every rank count, seeded
// sampling, the batch's per-row errors and resumption, and bad input named clearly. Generation's
// numerics (pass-Q decode == the reference's greedy loop) are tested in test_models_mplug.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "models/init.h"
#include "models/parallel.h"
#include "models/tokenizer/tokenizer.h"
#include "src/attention/layout.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/runtime/qa_media.h"
#include "src/runtime/video_qa.h"
#include "tests/build_paths.h"
#include "tests/video_test_util.h"
#include "video/sampler.h"

namespace lvx::runtime {
namespace {

using nlohmann::json;
using video::testing::make_video;
using video::testing::run;
using video::testing::temp_dir;

const std::string kLvx = lvx::testing::binary_dir() + "/lvx";

// A tiny random mPLUG-Owl3 directory (models/init.h), made once per process.
const std::string& tiny_model() {
  static const std::string dir = [] {
    const std::string d = (temp_dir() / "qa_model").string();
    models::TinyModelSpec spec;
    spec.words = {"red", "green", "blue", "What", "colour", "was", "the", "shape"};
    spec.seed = 3;
    models::write_tiny_mplug_owl3(d, spec);
    return d;
  }();
  return dir;
}

std::string clip() {
  return make_video("qa_clip.mp4", "testsrc=size=64x48:rate=4", "-t 12 -pix_fmt yuv420p");
}

json run_json(const std::string& args) {
  int rc = 0;
  const std::string out =
      run(kLvx + " qa --model " + tiny_model() + " " + args + " 2>/dev/null", &rc);
  EXPECT_EQ(rc, 0) << args;
  try {
    return json::parse(out);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not JSON: " << out;
    return json();
  }
}

std::string run_fail(const std::string& args) {
  int rc = 0;
  const std::string out = run(kLvx + " qa " + args + " 2>&1", &rc);
  EXPECT_NE(rc, 0) << out;
  return out;
}

TEST(QaPrompt, MplugChatTemplateEqualsTheTokenizersPackage) {
  // The template as text (the released processor's build_text_qwen, video as <|image|> × N):
  // the tokenizers package encodes it, lvx builds it from pieces.
  const std::string tok_path = tiny_model() + "/tokenizer.json";
  const std::string text =
      "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|image|><|image|><|image|>\nWhat "
      "colour was the shape?<|im_end|>\n<|im_start|>assistant\nred<|im_end|>";
  const std::string script = (temp_dir() / "encode.py").string();
  std::ofstream(script)
      << "import json, sys\nfrom tokenizers import Tokenizer\n"
      << "t = Tokenizer.from_file(sys.argv[1])\n"
      << "print(json.dumps(t.encode(sys.argv[2], add_special_tokens=False).ids))\n";
  const json want = json::parse(
      run(lvx::testing::configured_python() + " " + script + " " + tok_path + " '" + text + "'"));
  const models::Tokenizer tok = models::Tokenizer::from_file(tok_path);
  const std::string answer = "red";
  const PromptTokens p =
      models::family_of("mplugowl3", "test").prompt(tok, "What colour was the shape?", 3, &answer);
  EXPECT_EQ(json(p.ids), want);
  // Loss on the answer and the end of the turn only.
  const size_t n = p.ids.size();
  ASSERT_EQ(p.labels.size(), n);
  // (not shifted: the logits at t predict labels[t], the token at t + 1).
  for (size_t i = 0; i < n; ++i) {
    if (i != n - 3 && i != n - 2) {
      EXPECT_EQ(p.labels[i], -100) << i;
    }
  }
  EXPECT_EQ(p.ids[n - 2], *tok.token_to_id("red"));
  EXPECT_EQ(p.labels[n - 3], *tok.token_to_id("red"));
  EXPECT_EQ(p.labels[n - 2], *tok.token_to_id("<|im_end|>"));
  // Inference: the same prompt up to "assistant\n".
  const PromptTokens q =
      models::family_of("mplugowl3", "test").prompt(tok, "What colour was the shape?", 3);
  EXPECT_EQ(std::vector<int64_t>(p.ids.begin(), p.ids.end() - 2), q.ids);
  // Text only (lvx serve's chat without a video): chatml's user message is the question alone.
  const std::string text_only =
      "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nWhat colour was the shape?<|im_end|>\n"
      "<|im_start|>assistant\n";
  EXPECT_EQ(
      json(models::family_of("mplugowl3", "test").prompt(tok, "What colour was the shape?", 0).ids),
      json::parse(run(lvx::testing::configured_python() + " " + script + " " + tok_path + " '" +
                      text_only + "'")));
}

TEST(QaPrompt, MultipleChoiceUsesVideoMmeInstruction) {
  QaItem it;
  it.question = "Which colour?";
  it.options = {"red", "B. green", "blue"};
  EXPECT_EQ(question_text(it),
            "Select the best answer to the following multiple-choice question based on the "
            "video. Respond with only the letter (A, B, or C) of the correct option.\nWhich "
            "colour?\nA. red\nB. green\nC. blue\nThe best answer is:");
}

TEST(QaAnswers, LettersAndFreeFormAreExtractedAsLmmsEvalDoes) {
  QaItem mc;
  mc.options = {"red", "green", "blue", "cyan"};
  EXPECT_EQ(parse_answer(mc, "The best answer is: B."), "B");
  EXPECT_EQ(parse_answer(mc, "(C) blue"), "C");
  EXPECT_EQ(parse_answer(mc, "Answer: D"), "D");
  EXPECT_EQ(parse_answer(mc, "E"), "");  // not an option letter
  EXPECT_EQ(parse_answer(mc, "none"), "");
  mc.answer = "blue";
  EXPECT_EQ(expected_answer(mc), "C");
  EXPECT_EQ(training_target(mc), "C");  // fine-tuning learns the letter the instruction asks for
  mc.answer = "A";
  EXPECT_EQ(expected_answer(mc), "A");
  QaItem free;
  free.answer = "Red";
  EXPECT_EQ(expected_answer(free), "red");
  EXPECT_EQ(parse_answer(free, " red."), "red");
  EXPECT_EQ(training_target(free), "Red");
  EXPECT_NE(parse_answer(free, "green"), expected_answer(free));
}

TEST(QaFrames, EachRankDecodesExactlyTheImagesItsKeysHold) {
  // video::shard_positions and the model's key layout (models::media_layout, whole images) are
  // one split.
  for (int64_t m = 0; m < 30; ++m)
    for (int n = 1; n <= 5; ++n)
      for (int r = 0; r < n; ++r) {
        const std::vector<int64_t> frames = video::shard_positions(m, {r, n});
        const at::Tensor keys = models::media_layout(m, 4, n).positions(r);
        ASSERT_EQ(keys.numel(), static_cast<int64_t>(frames.size()) * 4)
            << m << " " << n << " " << r;
        for (size_t i = 0; i < frames.size(); ++i)
          EXPECT_EQ(keys[static_cast<int64_t>(i) * 4].item<int64_t>(), frames[i] * 4);
        EXPECT_EQ(models::media_slots(m, r, n), frames);
      }
}

TEST(QaJob, GreedyAnswersAreTheSameAtEveryRankCount) {
  const std::string args = "--video " + clip() +
                           " --question 'What colour was the shape?' --num-frames 6 --json "
                           "--max-new-tokens 6";
  const json one = run_json(args + " --nproc 1");
  ASSERT_TRUE(one.contains("response"));
  EXPECT_EQ(one["frames"], 6);
  EXPECT_EQ(one["new_tokens"], 6);
  for (const char* n : {"2", "3"}) {
    const json many = run_json(args + " --nproc " + n);
    EXPECT_EQ(many["response"], one["response"]) << n << " ranks";
    EXPECT_EQ(many["frame_indices"], one["frame_indices"]);
    EXPECT_GT(many["bytes"]["decode_per_token"].get<int64_t>(), 0);
  }
  EXPECT_EQ(one["bytes"]["decode"], 0);  // one rank sends nothing
}

TEST(QaJob, SamplingIsSeeded) {
  const std::string args = "--video " + clip() +
                           " --question 'What colour was the shape?' --num-frames 4 --json "
                           "--max-new-tokens 12 --temperature 2 --top-p 0.95";
  const json a = run_json(args + " --seed 5"), b = run_json(args + " --seed 5 --nproc 2");
  EXPECT_EQ(a["response"], b["response"]);
  const json c = run_json(args + " --seed 6");
  EXPECT_NE(a["response"], c["response"]);  // 12 tokens from a near-uniform tiny model
}

TEST(QaJob, BatchRowsCarryTheirErrorsAndARerunKeepsWhatWasWritten) {
  const std::string dir = (temp_dir() / "batch").string();
  std::filesystem::create_directories(dir);
  const std::string q = dir + "/q.jsonl", out = dir + "/answers.jsonl";
  std::ofstream(q)
      << json{{"id", "ok"}, {"video", clip()}, {"question", "What colour?"}, {"answer", "red"}}
             .dump()
      << "\n"
      << json{{"id", "missing"}, {"video", "nope.mp4"}, {"question", "Q?"}}.dump() << "\n"
      << json{{"id", "range"}, {"video", clip()}, {"question", "Q?"}, {"start", 100}}.dump() << "\n"
      << json{{"id", "noq"}, {"video", clip()}}.dump() << "\n"
      << json{{"id", "mc"},
              {"video", clip()},
              {"question", "Which?"},
              {"options", {"red", "green"}},
              {"answer", "A"}}
             .dump()
      << "\n";
  run(kLvx + " qa --model " + tiny_model() + " --questions " + q + " --output " + out +
      " --nproc 2 --num-frames 3 --max-new-tokens 2 2>/dev/null");
  std::vector<json> rows;
  std::ifstream in(out);
  for (std::string line; std::getline(in, line);) rows.push_back(json::parse(line));
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_TRUE(rows[0].contains("response") && rows[0].contains("correct"));
  EXPECT_NE(rows[1]["error"].get<std::string>().find("nope.mp4: no such video file"),
            std::string::npos)
      << rows[1];
  EXPECT_NE(rows[2]["error"].get<std::string>().find("start 100 s is at or past the end"),
            std::string::npos)
      << rows[2];
  EXPECT_NE(rows[3]["error"].get<std::string>().find("q.jsonl:4: missing field 'question'"),
            std::string::npos)
      << rows[3];
  EXPECT_TRUE(rows[4].contains("parsed_answer"));
  // Again: the answered rows stay as written and are not asked again; the failed ones are.
  std::ifstream before_in(out);
  const std::string before((std::istreambuf_iterator<char>(before_in)), {});
  run(kLvx + " qa --model " + tiny_model() + " --questions " + q + " --output " + out +
      " --num-frames 3 --max-new-tokens 2 2>/dev/null");
  std::ifstream after_in(out);
  const std::string after((std::istreambuf_iterator<char>(after_in)), {});
  ASSERT_EQ(after.substr(0, before.size()), before);
  int added = 0;
  for (size_t p = before.size(); (p = after.find('\n', p)) != std::string::npos; ++p) ++added;
  EXPECT_EQ(added, 3);  // missing, range, noq
}

TEST(QaJob, BadInputIsNamed) {
  const std::string m = "--model " + tiny_model();
  EXPECT_NE(run_fail(m + " --video " + clip() + " --question '  '").find("--question is empty"),
            std::string::npos);
  EXPECT_NE(run_fail(m + " --video /nonexistent.mp4 --question Q")
                .find("/nonexistent.mp4: no such video file"),
            std::string::npos);
  EXPECT_NE(run_fail(m + " --video " + clip() + " --question Q --start 30 --end 40")
                .find("start 30 s is at or past the end of the video"),
            std::string::npos);
  const std::string corrupt = (temp_dir() / "corrupt.mp4").string();
  std::ofstream(corrupt) << "this is not a video";
  EXPECT_NE(run_fail(m + " --video " + corrupt + " --question Q").find(corrupt), std::string::npos);
  const std::string empty_dir = (temp_dir() / "no_config").string();
  std::filesystem::create_directories(empty_dir);
  EXPECT_NE(
      run_fail("--model " + empty_dir + " --video " + clip() + " --question Q").find("config.json"),
      std::string::npos);
}

// Content keys (qa_media.h) are XXH3-128 under the session's secret: the same bytes give the
// same key under one secret and another key under another (lvx serve draws one per process, so a
// client cannot choose two videos of one key), the file's bytes decide it, and a short secret is
// refused.
TEST(QaMedia, ContentKeysDependOnTheSecret) {
  const std::string a = (temp_dir() / "key_a.bin").string(),
                    b = (temp_dir() / "key_b.bin").string();
  std::ofstream(a) << "the same bytes";
  std::ofstream(b) << "other bytes";
  std::string s1(192, '\0'), s2(192, '\0');  // as a session's: bytes that differ
  for (size_t i = 0; i < s1.size(); ++i) {
    s1[i] = static_cast<char>(i * 7 + 1);
    s2[i] = static_cast<char>(i * 13 + 5);
  }
  set_content_secret(s1);
  const std::string h1 = content_hash(a);
  EXPECT_EQ(h1.size(), 32u);
  EXPECT_EQ(content_hash(a), h1);
  EXPECT_NE(content_hash(b), h1);
  set_content_secret(s2);
  EXPECT_NE(content_hash(a), h1);
  set_content_secret(s1);
  EXPECT_EQ(content_hash(a), h1);
  EXPECT_EQ(h1, file_keyed_xxh3(a, s1));
  EXPECT_THROW(set_content_secret("short"), lvx::Error);
}

// srun's tasks are ranks (src/dist/rendezvous.h): two lvx qa processes given an srun step's
// variables by hand (2 tasks on one node, the node list's host as master) answer together, and
// rank 0's answer is the 1-rank one.
TEST(QaJob, SrunTasksAnswerAsRanks) {
  const std::string args = "--model " + tiny_model() + " --video " + clip() +
                           " --question 'What colour was the shape?' --num-frames 4 --json "
                           "--max-new-tokens 4";
  const json one = run_json(args + " --nproc 1");
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  const std::string step =
      "SLURM_STEP_ID=0 SLURM_STEP_NUM_TASKS=2 SLURM_NODEID=0 "
      "SLURM_STEP_TASKS_PER_NODE=2 SLURM_STEP_NODELIST=127.0.0.1 "
      "MASTER_PORT=" +
      std::to_string(port) + " ";
  int rc = 0;
  const std::string out =
      run("(" + step + "SLURM_PROCID=1 SLURM_LOCALID=1 " + kLvx + " qa " + args +
              " >/dev/null 2>&1 &); " + step + "SLURM_PROCID=0 SLURM_LOCALID=0 " + kLvx + " qa " +
              args + " 2>/dev/null",
          &rc);
  ASSERT_EQ(rc, 0) << out;
  const json two = json::parse(out);
  EXPECT_EQ(two["ranks"], 2);
  EXPECT_EQ(two["response"], one["response"]);
}

// --nproc auto prices the question at each rank count on the cluster config and starts the
// cheapest: on a host whose ranks share memory and cores (the config below, as lvx calibrate
// writes a CPU's) more ranks only add messages, so 1; without --cluster it says what to add.
TEST(QaJob, NprocAutoPricesTheQuestionOnTheClusterConfig) {
  const std::string cluster = (temp_dir() / "host.yaml").string();
  std::ofstream(cluster) << "name: host\ndevice: cpu\ngpus_per_node: 2\nnodes: 1\n"
                            "device_memory_gib: 8\n"
                            "attention_tflops: {fp32: {forward: 0.05, backward: 0.05}}\n"
                            "gemm_tflops: {fp32: 0.1}\n"
                            "intra_node: {bandwidth_gb_per_s: 1, latency_us: 100, sync_us: 400}\n"
                            "inter_node: {bandwidth_gb_per_s: 1, latency_us: 100, sync_us: 400}\n"
                            "memory: {bandwidth_gb_per_s: 30, shared: true}\n";
  const std::string args = "--model " + tiny_model() + " --video " + clip() +
                           " --question 'What colour was the shape?' --num-frames 4 --json "
                           "--max-new-tokens 4 --dtype fp32 --nproc auto";
  int rc = 0;
  const std::string out = run(kLvx + " qa " + args + " --cluster " + cluster + " 2>&1", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("1 rank: "), std::string::npos) << out;
  EXPECT_NE(out.find("2 ranks: "), std::string::npos) << out;
  EXPECT_NE(out.find("--nproc auto: 1 rank\n"), std::string::npos) << out;
  EXPECT_NE(out.find("\"ranks\":1"), std::string::npos) << out;
  EXPECT_NE(run_fail(args).find("--nproc auto prices the question on a cluster config: add "
                                "--cluster"),
            std::string::npos);
}

}  // namespace
}  // namespace lvx::runtime
