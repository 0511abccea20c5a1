// Training rows in the formats people bring (src/runtime/qa_rows.h): ms-swift JSONL
// ({"messages", "videos"}) and LLaVA/VILA ({"video", "conversations"}) as JSONL or one JSON
// array, multi-turn, with the loss on every assistant turn (Family::prompt_turns): the chatml
// conversation against the tokenizers package encoding the template written out by hand; a
// system message placed by the family's template, the prompt of a row the prompt lvx serve
// renders for the same conversation (serve::parse_chat_request); every bad row named by file,
// line and field; lvx finetune end to end on both formats.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "models/family.h"
#include "models/init.h"
#include "models/tokenizer/tokenizer.h"
#include "src/common/error.h"
#include "src/dist/process_group.h"
#include "src/runtime/qa_job.h"
#include "src/runtime/qa_rows.h"
#include "src/runtime/video_qa.h"
#include "src/serve/openai_api.h"
#include "tests/build_paths.h"
#include "tests/model_conformance.h"

namespace lvx::runtime {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::run_command;

fs::path dir() {
  static const fs::path d = [] {
    const fs::path p = testing::workdir() / "rows";
    fs::create_directories(p);
    return p;
  }();
  return d;
}

std::string write(const std::string& name, const std::string& text) {
  const std::string p = (dir() / name).string();
  std::ofstream(p) << text;
  return p;
}

// A 64×64 test video of `seconds` at 4 fps in the test folder; returns FFmpeg's complaints ("").
std::string make_clip(const std::string& name, int seconds) {
  return run_command("ffmpeg -loglevel error -y -f lavfi -i testsrc=size=64x64:rate=4 -t " +
                     std::to_string(seconds) + " -pix_fmt yuv420p " + (dir() / name).string());
}

const std::string& tiny_model() {
  static const std::string d = [] {
    const std::string m = (dir() / "model").string();
    models::TinyModelSpec spec;
    spec.words = {"red", "green", "blue", "What", "colour", "was", "the", "shape", "and", "now"};
    spec.seed = 5;
    models::write_tiny_mplug_owl3(m, spec);
    return m;
  }();
  return d;
}

TEST(TrainingRows, SwiftAndLlavaRowsBecomeConversations) {
  const std::string swift = write(
      "swift.jsonl",
      R"({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "<video>What colour?"}, {"role": "assistant", "content": "red"}, {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "blue"}], "videos": ["clip.mp4"], "id": "s1"})"
      "\n\n"
      R"({"messages": [{"role": "user", "content": "What shape?"}, {"role": "assistant", "content": "a circle"}], "videos": "/abs/v.mp4", "start": 1, "end": 2})"
      "\n");
  const auto rows = read_qa_rows(swift, "data.train", true, 1 << 20);
  ASSERT_EQ(rows.size(), 2u);
  ASSERT_EQ(rows[0].error, "");
  const QaItem& a = rows[0].item;
  EXPECT_EQ(a.id, "s1");
  EXPECT_EQ(a.video, (dir() / "clip.mp4").string());  // relative to the file's folder
  EXPECT_EQ(a.question, "What colour?");              // the tag is removed
  EXPECT_EQ(a.system, "");                            // an empty system message is none
  EXPECT_EQ(a.answer, "red");
  ASSERT_EQ(a.turns.size(), 1u);
  EXPECT_EQ(a.turns[0], (std::pair<std::string, std::string>{"And now?", "blue"}));
  EXPECT_EQ(rows[1].line, 3);
  EXPECT_EQ(rows[1].item.video, "/abs/v.mp4");
  EXPECT_EQ(rows[1].item.start.value_or(-1), 1.0);
  EXPECT_TRUE(rows[1].item.turns.empty());

  // LLaVA's JSON array: "line" is where each element starts.
  const std::string llava = write("llava.json", R"([
  {"id": "l1", "video": "v.mp4",
   "conversations": [{"from": "human", "value": "<video>\nWhat colour? [brackets], {braces}"},
                     {"from": "gpt", "value": "green"}]},
  {"video": "w.mp4", "conversations": [{"from": "human", "value": "<image>\nQ"}, {"from": "gpt", "value": "A"},
                                       {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]}
])");
  const auto l = read_qa_rows(llava, "data.train", true, 1 << 20);
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(l[0].line, 2);
  EXPECT_EQ(l[1].line, 5);
  EXPECT_EQ(l[0].item.question, "What colour? [brackets], {braces}");
  EXPECT_EQ(l[0].item.answer, "green");
  EXPECT_EQ(l[1].item.id, "line 5");
  EXPECT_EQ(l[1].item.question, "Q");
  ASSERT_EQ(l[1].item.turns.size(), 1u);
  EXPECT_EQ(l[1].item.turns[0].second, "A2");
}

TEST(TrainingRows, BadRowsNameFileLineAndField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"messages": [{"role": "assistant", "content": "x"}], "videos": ["v.mp4"]})",
       "field 'messages[0].content': expected a user turn"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "<video>q2"}, {"role": "assistant", "content": "b"}], "videos": ["v.mp4"]})",
       "field 'messages[2].content': a <video> tag outside the first user turn"},
      {R"({"messages": [{"role": "user", "content": "<video>q"}, {"role": "assistant", "content": "a"}], "videos": ["v.mp4", "w.mp4"]})",
       "field 'videos' must hold one video path"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "system", "content": "be brief"}, {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}], "videos": ["v.mp4"]})",
       "field 'messages[2].role': a system message after the first message"},
      {R"({"messages": [{"role": "system", "content": "be brief"}, {"role": "system", "content": "and kind"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "videos": ["v.mp4"]})",
       "field 'messages[1].role': a system message after the first message"},
      {R"({"video": "v.mp4", "conversations": [{"from": "human", "value": "q"}, {"from": "system", "value": "be brief"}, {"from": "gpt", "value": "a"}]})",
       "field 'conversations[1].from': a system message after the first message"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}], "videos": ["v.mp4"]})",
       "field 'messages[2].content': the conversation ends with a user turn"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})",
       "missing field 'videos'"},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "a"}], "videos": ["v.mp4"]})",
       "field 'messages[1].role': expected user, assistant or system, got 'tool'"},
      {R"({"video": "v.mp4", "conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]})",
       "field 'conversations[1].from': expected human, gpt or system, got 'bot'"},
      {R"({"video": "v.mp4", "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "a"}]})",
       "field 'conversations[0].value' is empty"},
      {R"({"video": "v.mp4", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]})",
       "field 'conversations[1].value' is empty"},
  };
  std::string text = "\n";  // rows start on line 2
  for (const auto& c : cases) text += c.first + "\n";
  const std::string path = write("bad.jsonl", text);
  const auto rows = read_qa_rows(path, "data.train", true, 1 << 20);
  ASSERT_EQ(rows.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(rows[i].line, static_cast<int64_t>(i) + 2);
    EXPECT_NE(rows[i].error.find(path + ":" + std::to_string(i + 2) + ": "), std::string::npos)
        << rows[i].error;
    EXPECT_NE(rows[i].error.find(cases[i].second), std::string::npos)
        << "row " << i << ": " << rows[i].error;
  }
  // A bad element of a JSON array is named by the line it starts on.
  const std::string arr = write("bad.json",
                                "[\n{\"video\": \"v.mp4\", \"conversations\": []},\n\n"
                                "  {\"video\": 3, \"conversations\": "
                                "[{\"from\": \"human\", \"value\": \"q\"}, "
                                "{\"from\": \"gpt\", \"value\": \"a\"}]}]");
  const auto a = read_qa_rows(arr, "data.train", true, 1 << 20);
  ASSERT_EQ(a.size(), 2u);
  EXPECT_NE(a[0].error.find(arr + ":2: the conversation has no turns"), std::string::npos)
      << a[0].error;
  EXPECT_NE(a[1].error.find(arr + ":4: field 'video' must be a string"), std::string::npos)
      << a[1].error;
}

// The ids the tokenizers package (PyPI) gives `text` with the tokenizer at `tok_path`, no
// special tokens added: the independent reference of the chat templates below.
json tokenizers_ids(const std::string& tok_path, const std::string& text) {
  const std::string script = write(
      "encode.py",
      "import json, sys\nfrom tokenizers import Tokenizer\nt = Tokenizer.from_file(sys.argv[1])\n"
      "print(json.dumps(t.encode(sys.argv[2], add_special_tokens=False).ids))\n");
  return json::parse(
      run_command(testing::python() + " " + script + " " + tok_path + " '" + text + "'"));
}

TEST(TrainingRows, MultiTurnChatmlEqualsTheTokenizersPackage) {
  // The conversation as text (Qwen chatml, continued turn by turn): the tokenizers package
  // encodes it, lvx builds it from pieces; the loss is on both answers and their <|im_end|>.
  const std::string tok_path = tiny_model() + "/tokenizer.json";
  const std::string text =
      "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|image|><|image|>\nWhat colour was the "
      "shape?<|im_end|>\n<|im_start|>assistant\nred<|im_end|>\n<|im_start|>user\nand "
      "now?<|im_end|>\n<|im_start|>assistant\ngreen blue<|im_end|>";
  const json want = tokenizers_ids(tok_path, text);
  const models::Tokenizer tok = models::Tokenizer::from_file(tok_path);
  QaItem item;
  item.question = "What colour was the shape?";
  item.answer = "red";
  item.turns = {{"and now?", "green blue"}};
  const models::Family& f = models::family_of("mplugowl3", "test");
  const PromptTokens p = training_prompt(f, tok, item, 2);
  EXPECT_EQ(json(p.ids), want);
  // Labelled (not shifted: labels[t] is the token at t + 1): "red<|im_end|>" and
  // "green blue<|im_end|>", nothing else.
  std::vector<int64_t> learned;
  for (size_t t = 0; t + 1 < p.ids.size(); ++t) {
    if (p.labels[t] == -100) continue;
    EXPECT_EQ(p.labels[t], p.ids[t + 1]) << t;
    learned.push_back(p.labels[t]);
  }
  EXPECT_EQ(p.labels.back(), -100);
  const int64_t im_end = *tok.token_to_id("<|im_end|>");
  std::vector<int64_t> expect = tok.encode("red", false, true);
  expect.push_back(im_end);
  for (int64_t id : tok.encode("green blue", false, true)) expect.push_back(id);
  expect.push_back(im_end);
  EXPECT_EQ(learned, expect);
  // One turn: the same as Family::prompt.
  item.turns.clear();
  const std::string answer = "red";
  EXPECT_EQ(training_prompt(f, tok, item, 2).ids,
            f.prompt(tok, "What colour was the shape?", 2, &answer).ids);
}

TEST(TrainingRows, ChatPromptEndsWhereTheAnswerBegins) {
  // lvx serve's conversations (Family::prompt_chat): the chatml text written out (a system
  // message as the processor's build_text_qwen writes it, an answered turn, the open question),
  // encoded whole by the tokenizers package.
  const std::string tok_path = tiny_model() + "/tokenizer.json";
  const std::string text =
      "<|im_start|>system\nthe shape<|im_end|>\n<|im_start|>user\n<|image|><|image|>\nWhat "
      "colour was the shape?<|im_end|>\n<|im_start|>assistant\nred<|im_end|>\n<|im_start|>user\n"
      "and now?<|im_end|>\n<|im_start|>assistant\n";
  const json want = tokenizers_ids(tok_path, text);
  const models::Tokenizer tok = models::Tokenizer::from_file(tok_path);
  const models::Family& f = models::family_of("mplugowl3", "test");
  const PromptTokens p =
      f.prompt_chat(tok, "the shape", {{"What colour was the shape?", "red"}}, "and now?", 2);
  EXPECT_EQ(json(p.ids), want);
  EXPECT_EQ(p.labels, std::vector<int64_t>(p.ids.size(), -100));
  // No system message and no earlier turn: exactly lvx qa's prompt.
  EXPECT_EQ(f.prompt_chat(tok, "", {}, "What colour was the shape?", 3).ids,
            f.prompt(tok, "What colour was the shape?", 3).ids);
  // The conversation's prompt is the training prompt of the same turns without the last answer.
  QaItem item;
  item.question = "What colour was the shape?";
  item.answer = "red";
  item.turns = {{"and now?", "green"}};
  const std::vector<int64_t> trained = training_prompt(f, tok, item, 2).ids;
  const std::vector<int64_t> asked =
      f.prompt_chat(tok, "", {{"What colour was the shape?", "red"}}, "and now?", 2).ids;
  ASSERT_LT(asked.size(), trained.size());
  EXPECT_EQ(asked, std::vector<int64_t>(trained.begin(), trained.begin() + asked.size()));
  EXPECT_THROW(f.prompt_chat(tok, "", {{"What colour?", "red"}}, " ", 2), Error);
}

TEST(TrainingRows, MultiTurnOpenFlamingoChainsQuestions) {
  // OpenFlamingo's template chains turns as its few-shot prompts chain examples; the pieces are
  // encoded by the tokenizers package (lvx encodes each piece alone, as its template does).
  const std::string of = lvx::testing::source_dir() + "/tests/reference/openflamingo_ref.py";
  std::string log;
  const std::string d = testing::generated(
      "rows_flamingo",
      testing::script_stamp(of) +
          testing::read_text(lvx::testing::source_dir() +
                             "/models/openflamingo/convert_openflamingo.py"),
      [&](const std::string& o) {
        return run_command(testing::python() + " " + of + " make-model " + o + "/model --lm llama");
      },
      &log);
  ASSERT_FALSE(d.empty()) << log;
  const std::string tok_path = d + "/model/tokenizer.json";
  const std::string script = write(
      "encode_pieces.py",
      "import json, sys\nfrom tokenizers import Tokenizer\nt = Tokenizer.from_file(sys.argv[1])\n"
      "print(json.dumps([t.encode(s, add_special_tokens=False).ids for s in sys.argv[2:]]))\n");
  const json pieces =
      json::parse(run_command(testing::python() + " " + script + " " + tok_path +
                              " 'Question:q one Short answer:' 'a one' 'Question:q two Short "
                              "answer:' 'a two' '<|endofchunk|>' '<image>'"));
  ASSERT_EQ(pieces.size(), 6u);
  auto ids = [&](size_t i) { return pieces[i].get<std::vector<int64_t>>(); };
  const int64_t eoc = ids(4).at(0), image = ids(5).at(0);
  std::vector<int64_t> want{image, eoc, image};
  std::vector<int64_t> learned;
  for (size_t i = 0; i < 4; ++i) {
    for (int64_t id : ids(i)) {
      want.push_back(id);
      if (i % 2 == 1) learned.push_back(id);
    }
    if (i % 2 == 1) want.push_back(eoc), learned.push_back(eoc);
  }
  const models::Tokenizer tok = models::Tokenizer::from_file(tok_path);
  QaItem item;
  item.question = "q one";
  item.answer = "a one";
  item.turns = {{"q two", "a two"}};
  const PromptTokens p = training_prompt(models::family_of("openflamingo", "test"), tok, item, 2);
  EXPECT_EQ(p.ids, want);
  std::vector<int64_t> got;
  for (size_t t = 0; t + 1 < p.ids.size(); ++t)
    if (p.labels[t] != -100) {
      EXPECT_EQ(p.labels[t], p.ids[t + 1]);
      got.push_back(p.labels[t]);
    }
  EXPECT_EQ(got, learned);
  // lvx serve's conversation (Family::prompt_chat): the same chain, then the open question; no
  // system message (the evaluation prompt has none: refused, named).
  const models::Family& f = models::family_of("openflamingo", "test");
  const PromptTokens chat = f.prompt_chat(tok, "", {{"q one", "a one"}}, "q two", 2);
  std::vector<int64_t> open(
      want.begin(), want.begin() + 3 + static_cast<int64_t>(ids(0).size() + ids(1).size() + 1));
  for (int64_t id : ids(2)) open.push_back(id);
  EXPECT_EQ(chat.ids, open);
  EXPECT_EQ(f.prompt_chat(tok, "", {}, "q one", 2).ids, f.prompt(tok, "q one", 2).ids);
  try {
    f.prompt_chat(tok, "Be brief.", {}, "q one", 2);
    ADD_FAILURE() << "a system message was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("OpenFlamingo's prompt template has no system message"),
              std::string::npos)
        << e.what();
  }
}

// The rows file `name` holding one ms-swift row of `messages` (the <video> tag put in the first
// user message), read as lvx finetune reads data.train.
QaLine swift_row(const std::string& name, json messages) {
  for (json& m : messages)
    if (m["role"] == "user") {
      m["content"] = "<video>" + m["content"].get<std::string>();
      break;
    }
  const json row{{"messages", messages}, {"videos", {"clip.mp4"}}};
  const auto rows = read_qa_rows(write(name, row.dump() + "\n"), "data.train", true, 1 << 20);
  EXPECT_EQ(rows.size(), 1u);
  return rows.at(0);
}

// lvx serve's question of an OpenAI chat request with `messages` (a video_url part put first in
// the first user message): the body read by serve::parse_chat_request, the QaRequest filled as
// the server fills it (Server::check_conversation, Server::answer).
QaRequest served_request(json messages) {
  for (json& m : messages)
    if (m["role"] == "user") {
      const json video{{"type", "video_url"},
                       {"video_url", {{"url", "data:video/mp4;base64,AAAA"}}}};
      m["content"] = json::array({video, {{"type", "text"}, {"text", m["content"]}}});
      break;
    }
  serve::ApiOptions o;
  o.model_name = "tiny";
  const serve::ChatRequest r =
      serve::parse_chat_request(json{{"model", "tiny"}, {"messages", messages}}.dump(), o);
  QaRequest q;
  q.item.question = r.question;
  q.item.system = r.system;
  q.earlier = r.earlier;
  return q;
}

// The prompt QaSession::prompt renders for `q` (the family's prompt_chat), for families with no
// tiny model to load a session on.
PromptTokens served_prompt(const models::Family& f, const models::Tokenizer& tok,
                           const QaRequest& q, int64_t frames) {
  return f.prompt_chat(tok, q.item.system, q.earlier, question_text(q.item), frames);
}

// Train and serve render one prompt: the served ids (and their text) are the training ids up to
// where the last answer begins, and the training labels start that answer right there.
void expect_one_prompt(const PromptTokens& served, const PromptTokens& trained,
                       const models::Tokenizer& tok) {
  const size_t n = served.ids.size();
  ASSERT_GE(n, 2u);
  ASSERT_LT(n, trained.ids.size());
  const std::vector<int64_t> head(trained.ids.begin(), trained.ids.begin() + n);
  EXPECT_EQ(tok.decode(served.ids), tok.decode(head));
  EXPECT_EQ(served.ids, head);
  EXPECT_EQ(trained.labels[n - 2], -100);            // the prompt's last token is not learned...
  EXPECT_EQ(trained.labels[n - 1], trained.ids[n]);  // ...the answer's first one is
}

// The error `f` throws ("" when it throws none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TrainingRows, SystemMessageGoesWhereTheTemplatePutsIt) {
  // An ms-swift row and a LLaVA row with a system message first: it travels with the row and
  // mPLUG-Owl3's chatml places it in its system turn (the processor's build_text_qwen), the text
  // written out by hand and encoded whole by the tokenizers package.
  const std::string system = "You are a careful viewer.";
  const QaLine s =
      swift_row("system_swift.jsonl", json::array({{{"role", "system"}, {"content", system}},
                                                   {{"role", "user"}, {"content", "What colour?"}},
                                                   {{"role", "assistant"}, {"content", "red"}}}));
  ASSERT_EQ(s.error, "");
  EXPECT_EQ(s.item.system, system);
  const std::string llava = write(
      "system_llava.json",
      R"([{"video": "v.mp4", "conversations": [{"from": "system", "value": "You are a careful viewer."}, {"from": "human", "value": "<video>\nWhat colour?"}, {"from": "gpt", "value": "red"}]}])");
  const auto l = read_qa_rows(llava, "data.train", true, 1 << 20);
  ASSERT_EQ(l.size(), 1u);
  ASSERT_EQ(l[0].error, "");
  EXPECT_EQ(l[0].item.system, system);

  const std::string tok_path = tiny_model() + "/tokenizer.json";
  const models::Tokenizer tok = models::Tokenizer::from_file(tok_path);
  const std::string text =
      "<|im_start|>system\nYou are a careful viewer.<|im_end|>\n<|im_start|>user\n<|image|>"
      "<|image|>\nWhat colour?<|im_end|>\n<|im_start|>assistant\nred<|im_end|>";
  const models::Family& f = models::family_of("mplugowl3", "test");
  for (const QaItem& item : {s.item, l[0].item}) {
    const PromptTokens p = training_prompt(f, tok, item, 2);
    EXPECT_EQ(tok.decode(p.ids), text);
    EXPECT_EQ(json(p.ids), tokenizers_ids(tok_path, text));
  }
}

TEST(TrainingRows, TrainAndServeRenderOnePrompt) {
  // One conversation as a training row and as an lvx serve request (the same messages, the
  // request without the last answer): one prompt, for mPLUG-Owl3 with a system message, one
  // turn and two, and through the QaSession that lvx serve answers with.
  const json system = {{"role", "system"}, {"content", "You are a careful viewer."}};
  const json q1 = {{"role", "user"}, {"content", "What colour was the shape?"}};
  const json a1 = {{"role", "assistant"}, {"content", "red"}};
  const json q2 = {{"role", "user"}, {"content", "and now?"}};
  const json a2 = {{"role", "assistant"}, {"content", "green blue"}};
  const models::Tokenizer tok = models::Tokenizer::from_file(tiny_model() + "/tokenizer.json");
  const models::Family& f = models::family_of("mplugowl3", "test");
  QaJob job;
  job.model = tiny_model();
  job.device = "cpu";
  const QaSession session(job, std::make_shared<dist::ProcessGroup>(dist::RendezvousInfo{}));
  const std::vector<std::pair<json, json>> convos = {
      {json::array({system, q1}), a1},
      {json::array({system, q1, a1, q2}), a2},
      {json::array({q1, a1, q2}), a2},
  };
  for (const auto& [asked, answer] : convos) {
    SCOPED_TRACE(asked.dump());
    json row = asked;
    row.push_back(answer);
    const QaLine l = swift_row("one_prompt.jsonl", row);
    ASSERT_EQ(l.error, "");
    const PromptTokens trained = training_prompt(f, tok, l.item, 3);
    const QaRequest q = served_request(asked);
    EXPECT_EQ(q.item.system, l.item.system);
    expect_one_prompt(session.prompt(q, 3), trained, tok);
    EXPECT_EQ(session.prompt(q, 3).ids, served_prompt(f, tok, q, 3).ids);
  }
}

// A tokenizer with every family's special tokens (the tiny one's words and Qwen's, then
// Llama-3.2-Vision's and OpenFlamingo's): each family's template renders with it, no model.
const std::string& every_family_tokenizer() {
  static const std::string p = [] {
    json t = json::parse(models::tiny_tokenizer_json({"red", "What", "colour", "Be", "brief"}));
    int64_t id = 0;
    for (const json& a : t["added_tokens"]) id = std::max(id, a["id"].get<int64_t>() + 1);
    for (const char* s : {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                          "<|eot_id|>", "<image>", "<|endofchunk|>"}) {
      json a = t["added_tokens"][0];
      a["id"] = id++;
      a["content"] = s;
      t["added_tokens"].push_back(a);
    }
    return write("every_family_tokenizer.json", t.dump());
  }();
  return p;
}

TEST(TrainingRows, TrainAndServeTakeOrRefuseOneSystemMessage) {
  // OpenFlamingo and Llama-3.2-Vision: a conversation with no system message (or an empty one,
  // or for Llama a blank one) renders one prompt; a system message their template has no place
  // for is accepted by the row reader and refused by the template, for training and serving
  // alike, with one message.
  const models::Tokenizer tok = models::Tokenizer::from_file(every_family_tokenizer());
  const json q = {{"role", "user"}, {"content", "What colour?"}};
  const json a = {{"role", "assistant"}, {"content", "red"}};
  for (const char* type : {"openflamingo", "mllama"}) {
    const models::Family& f = models::family_of(type, "test");
    const std::string blank = std::string(type) == "mllama" ? " \n" : "";
    for (const std::string& system : {std::string(), blank, std::string("Be brief.")}) {
      SCOPED_TRACE(std::string(type) + ", system '" + system + "'");
      const json sys = {{"role", "system"}, {"content", system}};
      const QaLine l = swift_row("flamingo_llama.jsonl", json::array({sys, q, a}));
      ASSERT_EQ(l.error, "");
      EXPECT_EQ(l.item.system, system);
      const QaRequest r = served_request(json::array({sys, q}));
      const std::string train_error = error_of([&] { training_prompt(f, tok, l.item, 2); });
      const std::string serve_error = error_of([&] { served_prompt(f, tok, r, 2); });
      EXPECT_EQ(train_error, serve_error);
      if (system == "Be brief.") {
        EXPECT_NE(train_error.find("system message"), std::string::npos) << train_error;
        continue;
      }
      ASSERT_EQ(train_error, "");
      expect_one_prompt(served_prompt(f, tok, r, 2), training_prompt(f, tok, l.item, 2), tok);
    }
  }
}

TEST(TrainingRows, FinetuneReadsSwiftJsonlAndLlavaJson) {
  ASSERT_EQ(make_clip("clip.mp4", 4), "");
  const std::string swift = write(
      "train_swift.jsonl",
      R"({"messages": [{"role": "system", "content": "You are a careful viewer."}, {"role": "user", "content": "<video>What colour?"}, {"role": "assistant", "content": "red"}, {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "blue"}], "videos": ["clip.mp4"]})"
      "\n");
  const std::string llava = write(
      "train_llava.json",
      R"([{"video": "clip.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat shape?"}, {"from": "gpt", "value": "green"}]}])");
  for (const std::string& data : {swift, llava}) {
    const std::string ck = (dir() / ("ck_" + fs::path(data).stem().string())).string();
    fs::remove_all(ck);
    const std::string cfg = write(
        "run.yaml", "model: {path: " + tiny_model() + "}\ndata: {train: " + data +
                        ", num_frames: 2}\nschedule: {steps: 2}\ncheckpoint: {dir: " + ck + "}\n");
    const std::string log = run_command(testing::lvx_binary() + " finetune --config " + cfg);
    ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
    EXPECT_TRUE(fs::exists(ck + "/step-000002/model.safetensors")) << data;
    std::ifstream m(ck + "/metrics.jsonl");
    int steps = 0;
    for (std::string line; std::getline(m, line); ++steps)
      EXPECT_TRUE(std::isfinite(json::parse(line)["loss"].get<double>())) << line;
    EXPECT_EQ(steps, 2) << data;
  }
  // A bad row stops the run before it starts, naming file, line and field.
  const std::string bad = write(
      "train_bad.jsonl",
      R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "videos": ["clip.mp4"]})"
      "\n"
      R"({"messages": [{"role": "user", "content": "q"}], "videos": ["clip.mp4"]})"
      "\n");
  const std::string cfg =
      write("bad.yaml", "model: {path: " + tiny_model() + "}\ndata: {train: " + bad +
                            ", num_frames: 2}\nschedule: {steps: 1}\ncheckpoint: {dir: " +
                            (dir() / "ck_bad").string() + "}\n");
  const std::string log = run_command(testing::lvx_binary() + " finetune --config " + cfg);
  EXPECT_NE(log.find(bad + ":2: field 'messages[0].content': the conversation ends with a user"),
            std::string::npos)
      << log;
  EXPECT_FALSE(fs::exists(dir() / "ck_bad"));
}

// A family whose template has no place for a system message (Llama-3.2-Vision) refuses a row
// that carries one before the run starts, naming the file and line; nothing is written.
TEST(TrainingRows, SystemMessageTheTemplateRefusesStopsTheRunFirst) {
  const std::string ref = lvx::testing::source_dir() + "/tests/reference/mllama_ref.py";
  const testing::Reference mllama =
      testing::reference_model("mllama", ref, testing::script_stamp(ref), "", "--length 24");
  ASSERT_EQ(make_clip("clip_sys.mp4", 2), "");
  const std::string rows = write(
      "train_sys.jsonl",
      R"({"messages": [{"role": "user", "content": "<video>What colour?"}, {"role": "assistant", "content": "red"}], "videos": ["clip_sys.mp4"]})"
      "\n"
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<video>What colour?"}, {"role": "assistant", "content": "red"}], "videos": ["clip_sys.mp4"]})"
      "\n");
  const std::string ck = (dir() / "ck_sys").string();
  fs::remove_all(ck);
  const std::string cfg = write(
      "sys.yaml", "model: {path: " + mllama.model + "}\ndata: {train: " + rows +
                      ", num_frames: 1}\nschedule: {steps: 1}\ncheckpoint: {dir: " + ck + "}\n");
  const std::string log = run_command(testing::lvx_binary() + " finetune --config " + cfg);
  EXPECT_NE(log.find(rows + ":2: "), std::string::npos) << log;
  EXPECT_NE(log.find("system"), std::string::npos) << log;
  EXPECT_NE(log.find("exit status"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(ck + "/latest"));
}

}  // namespace
}  // namespace lvx::runtime
