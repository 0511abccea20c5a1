#include "src/runtime/qa_job.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>

#include "src/common/error.h"
#include "src/dist/process_group.h"
#include "src/runtime/model_description.h"
#include "src/runtime/video_qa.h"
#include "video/pipeline.h"

namespace lvx::runtime {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using clock = std::chrono::steady_clock;
double since(clock::time_point t) {
  return std::chrono::duration<double>(clock::now() - t).count();
}

at::ScalarType dtype_of(const std::string& name) {
  if (name == "fp32") return at::kFloat;
  if (name == "bf16") return at::kBFloat16;
  LVX_FAIL("--dtype: expected fp32 or bf16, got '", name, "'");
}

// Every rank's error for one question (empty: fine), so that all ranks skip it together: a
// damaged frame may sit in one rank's share only. Returns the first rank's message, naming it.
std::string agree_on_error(dist::ProcessGroup& pg, const std::string& error) {
  constexpr int64_t kMax = 1024;
  at::Tensor mine = at::zeros({1, kMax}, at::kByte);
  std::memcpy(mine.data_ptr<uint8_t>(), error.data(), std::min<size_t>(error.size(), kMax - 1));
  const at::Tensor all = pg.world_size() > 1 ? pg.all_gather(mine) : mine;
  for (int r = 0; r < pg.world_size(); ++r) {
    const std::string msg(reinterpret_cast<const char*>(all[r].data_ptr<uint8_t>()));
    if (!msg.empty()) return pg.world_size() > 1 ? str("rank ", r, ": ", msg) : msg;
  }
  return "";
}

// Text streamed to stdout as tokens arrive; an incomplete UTF-8 character waits for its rest.
class TextStream {
 public:
  TextStream(const models::Tokenizer& tok, std::vector<int64_t> stop)
      : tok_(tok), stop_(std::move(stop)) {}
  void add(int64_t id) {
    if (done_ || std::find(stop_.begin(), stop_.end(), id) != stop_.end()) {
      done_ = true;
      return;
    }
    ids_.push_back(id);
    const std::string text = tok_.decode(ids_, /*skip_special_tokens=*/true);
    if (text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0) return;
    if (text.size() > printed_ && text.compare(0, printed_, text, 0, printed_) == 0) {
      std::cout << text.substr(printed_) << std::flush;
      printed_ = text.size();
    }
  }

 private:
  const models::Tokenizer& tok_;
  std::vector<int64_t> stop_;
  std::vector<int64_t> ids_;
  size_t printed_ = 0;
  bool done_ = false;
};

struct Context {
  const QaJob& job;
  std::shared_ptr<dist::ProcessGroup> pg;
  models::Model& model;
  const models::Tokenizer& tok;
  video::PreprocessConfig preprocess;
  std::vector<int64_t> stop;
};

// Answers one question on every rank; the row (rank 0's is complete). Errors of the video (on
// any rank) become the row's "error".
json answer(const Context& cx, const QaItem& item, bool stream) {
  dist::ProcessGroup& pg = *cx.pg;
  const int n = pg.world_size(), r = pg.rank();
  json row{{"id", item.id}, {"video", item.video}, {"question", item.question}};
  if (!item.options.empty()) row["options"] = item.options;
  if (!item.answer.empty()) row["answer"] = item.answer;
  const auto t_start = clock::now();
  video::SampleSpec spec;
  spec.fps = cx.job.fps;
  spec.num_frames =
      cx.job.fps ? std::nullopt : std::optional<int64_t>(cx.job.num_frames.value_or(16));
  spec.start = item.start ? item.start : cx.job.start;
  spec.end = item.end ? item.end : cx.job.end;
  video::FrameBatch frames;
  std::string error;
  try {
    LVX_CHECK(fs::exists(item.video), item.video, ": no such video file");
    frames = video::decode_video(item.video, spec, {r, n}, cx.preprocess);
  } catch (const std::exception& e) {
    error = e.what();
  }
  error = agree_on_error(pg, error);
  if (!error.empty()) {
    row["error"] = error;
    return row;
  }
  const double video_s = since(t_start);
  const int64_t m = frames.report.sampled_total;
  const PromptTokens prompt = build_prompt(cx.model.family(), cx.tok, question_text(item), m);
  const at::Tensor ids = at::tensor(prompt.ids, at::kLong).unsqueeze(0);
  std::string plan_text;
  models::Parallel par = plan_layers(cx.model, ids, n, cx.job.plan, &plan_text);
  par.pg = cx.pg;
  if (cx.job.print_plan && r == 0) std::cerr << plan_text << "\n" << describe(par, &cx.model) << "\n";

  TextStream text(cx.tok, cx.stop);
  GenerateOptions g = cx.job.generation;
  if (!cx.job.ignore_stop) g.stop = cx.stop;
  const GenerateResult out = generate(cx.model, {ids, frames.frames, /*pixels_local=*/true}, par, g,
                                      [&](const at::Tensor& next) {
                                        if (stream && r == 0) text.add(next[0].item<int64_t>());
                                      });
  if (stream && r == 0) std::cout << "\n" << std::flush;
  std::vector<int64_t> answer_ids;
  for (int64_t i = 0; i < out.tokens.size(1); ++i) {
    const int64_t id = out.tokens[0][i].item<int64_t>();
    if (std::find(cx.stop.begin(), cx.stop.end(), id) != cx.stop.end()) break;
    answer_ids.push_back(id);
  }
  const std::string response = cx.tok.decode(answer_ids, /*skip_special_tokens=*/true);

  // The slowest rank's timings; every rank's bytes; every rank's frames in sampled order.
  double per_token = 0;
  for (double t : out.token_seconds) per_token += t;
  if (!out.token_seconds.empty()) per_token /= static_cast<double>(out.token_seconds.size());
  at::Tensor times = at::tensor(
      {video_s, out.encode_seconds, out.prefill_seconds, per_token, since(t_start)}, at::kDouble);
  pg.all_reduce(times, dist::ReduceOp::kMax);
  at::Tensor bytes = at::tensor({out.prefill_bytes_sent, out.decode_bytes_sent}, at::kLong);
  pg.all_reduce(bytes);
  const std::vector<int64_t> sizes = [&] {
    std::vector<int64_t> s(n);
    for (int k = 0; k < n; ++k)
      s[k] = video::shard_range(m, {k, n}).second - video::shard_range(m, {k, n}).first;
    return s;
  }();
  const at::Tensor indices = pg.all_gather(frames.indices, sizes);
  const at::Tensor pts = pg.all_gather(frames.pts, sizes);

  row["response"] = response;
  row["parsed_answer"] = parse_answer(item, response);
  if (!item.answer.empty()) row["correct"] = row["parsed_answer"] == expected_answer(item);
  row["frames"] = m;
  row["frame_indices"] = std::vector<int64_t>(indices.data_ptr<int64_t>(),
                                              indices.data_ptr<int64_t>() + indices.numel());
  row["pts_seconds"] =
      std::vector<double>(pts.data_ptr<double>(), pts.data_ptr<double>() + pts.numel());
  row["prompt_tokens"] = static_cast<int64_t>(prompt.ids.size());
  row["new_tokens"] = out.tokens.size(1);
  row["ranks"] = n;
  row["plan"] = describe(par, &cx.model);
  const double ttft = times[0].item<double>() + times[2].item<double>();
  row["timings"] = {
      {"video_decode_s", times[0].item<double>()},     {"encode_s", times[1].item<double>()},
      {"prefill_s", times[2].item<double>()},          {"ttft_s", ttft},
      {"decode_per_token_s", times[3].item<double>()}, {"total_s", times[4].item<double>()}};
  const int64_t steps = std::max<int64_t>(1, out.tokens.size(1) - 1);
  row["bytes"] = {{"prefill", bytes[0].item<int64_t>()},
                  {"decode", bytes[1].item<int64_t>()},
                  {"decode_per_token", bytes[1].item<int64_t>() / steps}};
  return row;
}

// Ids already answered (without error) in an existing output file.
std::set<std::string> answered_ids(const std::string& path) {
  std::set<std::string> ids;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    try {
      const json row = json::parse(line);
      if (row.contains("id") && !row.contains("error")) ids.insert(row["id"].get<std::string>());
    } catch (const std::exception&) {
      // A line cut by a kill: asked again.
    }
  }
  return ids;
}

}  // namespace

void validate_qa_job(const QaJob& job) {
  dtype_of(job.plan.dtype);
  LVX_CHECK(fs::is_directory(job.model), job.model,
            ": not a directory (expected a checkpoint directory with config.json)");
  planner_model(job.model);  // config.json names a known family
  LVX_CHECK(fs::exists(fs::path(job.model) / "tokenizer.json"), job.model,
            ": has no tokenizer.json (lvx qa builds the prompt with it)");
  LVX_CHECK(!(job.fps && job.num_frames), "give --fps or --num-frames, not both");
  LVX_CHECK(!job.fps || *job.fps > 0, "--fps must be > 0, got ", job.fps.value_or(0));
  LVX_CHECK(!job.num_frames || *job.num_frames >= 1, "--num-frames must be >= 1");
  LVX_CHECK(!(job.start && job.end) || *job.start < *job.end, "--start (", job.start.value_or(0),
            ") must be before --end (", job.end.value_or(0), ")");
  if (!job.plan.strategies.empty() && job.plan.strategies != "auto")
    explicit_strategies(job.plan.strategies, 1);
  if (!job.questions.empty()) {
    LVX_CHECK(job.video.empty() && job.question.empty(),
              "give --questions (a JSONL file) or --video and --question, not both");
    LVX_CHECK(fs::exists(job.questions), job.questions, ": no such file (--questions)");
    LVX_CHECK(!job.output.empty(), "--questions needs --output (a JSONL file of answers)");
    const fs::path dir = fs::absolute(job.output).parent_path();
    LVX_CHECK(fs::is_directory(dir), job.output, ": folder ", dir.string(), " does not exist");
    return;
  }
  LVX_CHECK(!job.video.empty(), "--video is required (or --questions FILE)");
  LVX_CHECK(fs::exists(job.video), job.video, ": no such video file");
  LVX_CHECK(job.question.find_first_not_of(" \t\r\n") != std::string::npos, "--question is empty");
}

int run_qa_rank(const QaJob& job) {
  auto pg = dist::ProcessGroup::from_env();
  const int r = pg->rank();
  std::unique_ptr<models::Model> model = models::load_model(job.model, dtype_of(job.plan.dtype));
  const models::Tokenizer tok = models::Tokenizer::from_file(job.model + "/tokenizer.json");
  const Context cx{job,
                   pg,
                   *model,
                   tok,
                   family_preprocess(model->family(), model->planner_model().vision.image_size),
                   stop_tokens(model->family(), tok)};

  if (job.questions.empty()) {  // one question
    QaItem item;
    item.id = "question";
    item.video = job.video;
    item.question = job.question;
    item.options = job.options;
    const json row = answer(cx, item, /*stream=*/!job.json);
    LVX_CHECK(!row.contains("error"), row["error"].get<std::string>());
    if (r == 0 && job.json) std::cout << row.dump() << std::endl;
    if (r == 0 && !job.json)
      std::cerr << "[qa] " << row["frames"] << " frames on " << pg->world_size()
                << " ranks, time to first token " << row["timings"]["ttft_s"] << " s, "
                << row["timings"]["decode_per_token_s"] << " s per token, decode bytes/token "
                << row["bytes"]["decode_per_token"] << "\n";
    pg->barrier();
    return 0;
  }

  const std::vector<QaLine> lines = read_qa_jsonl(job.questions, /*need_answer=*/false);
  const std::set<std::string> done = answered_ids(job.output);  // every rank, before any write
  pg->barrier();
  std::ofstream out;
  if (r == 0) {
    out.open(job.output, std::ios::app);
    LVX_CHECK(out.good(), job.output, ": cannot open for writing");
  }
  int64_t answered = 0, failed = 0, skipped = 0, scored = 0, correct = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const QaLine& l = lines[i];
    if (done.count(l.item.id)) {
      ++skipped;
      continue;
    }
    json row;
    if (!l.error.empty()) {
      row = {{"id", l.item.id}, {"line", l.line}, {"error", l.error}};
    } else {
      row = answer(cx, l.item, /*stream=*/false);
    }
    if (row.contains("error")) {
      ++failed;
    } else {
      ++answered;
      if (row.contains("correct")) {
        ++scored;
        correct += row["correct"].get<bool>() ? 1 : 0;
      }
    }
    if (r == 0) {
      out << row.dump() << "\n" << std::flush;
      std::cerr << "[qa " << i + 1 << "/" << lines.size() << "] " << l.item.id << ": "
                << (row.contains("error") ? "error: " + row["error"].get<std::string>()
                                          : row["response"].dump())
                << (row.contains("correct")
                        ? (row["correct"].get<bool>() ? " (correct)" : " (wrong)")
                        : "")
                << "\n";
    }
  }
  if (r == 0) {
    std::cerr << "[qa] answered " << answered << ", failed " << failed;
    if (skipped) std::cerr << ", already in " << job.output << " " << skipped;
    if (scored)
      std::cerr << "; accuracy " << correct << "/" << scored << " = "
                << 100.0 * static_cast<double>(correct) / static_cast<double>(scored) << "%";
    std::cerr << "\n";
  }
  pg->barrier();
  return 0;
}

}  // namespace lvx::runtime
