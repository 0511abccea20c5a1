// Over 600 lines: questions answered one at a time and in parts (start / step / finish, what lvx
// serve's scheduler drives) share State and its helpers here; issue 33 (structure) splits the
// media (frames, cache keys), the answer's parts and the batch mode into files of their own.
#include "src/runtime/qa_job.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "models/lora.h"
#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/dist/process_group.h"
#include "src/runtime/device.h"
#include "src/runtime/logprobs_json.h"
#include "src/runtime/model_description.h"
#include "src/runtime/qa_media.h"
#include "src/runtime/qa_session_state.h"
#include "src/runtime/video_qa.h"
#include "video/pipeline.h"

namespace lvx::runtime {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// JSON text of a row. A question or path with invalid UTF-8 (JSON parsing keeps such bytes) is
// written with U+FFFD in their place instead of failing the whole batch.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Ids already answered (without error) in an existing output file. A line that is not JSON (an
// older run's damage) is asked again, said once on stderr by rank 0.
std::set<std::string> answered_ids(const std::string& path, int rank) {
  std::set<std::string> ids;
  if (!fs::exists(path)) return ids;
  const std::string text = read_file(path, "answers file (--output)", uint64_t{4} << 30);
  int64_t bad = 0, number = 0;
  for (size_t b = 0; b < text.size();) {
    size_t e = text.find('\n', b);
    if (e == std::string::npos) e = text.size();
    const std::string line = text.substr(b, e - b);
    b = e + 1;
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const json row = parse_json(line, str(path, " line ", number));
      if (row.is_object() && row.contains("id") && row["id"].is_string() && !row.contains("error"))
        ids.insert(row["id"].get<std::string>());
    } catch (const Error&) {
      ++bad;
    }
  }
  if (bad && rank == 0)
    std::cerr << "lvx qa: " << path << ": " << bad << " line" << (bad == 1 ? " is" : "s are")
              << " not JSON rows; their questions are asked again\n";
  return ids;
}

std::string settings_path(const std::string& output) { return output + ".settings.json"; }

// Refuses to add answers of other settings to an output (every rank, before any write). Returns
// true when the output already holds something (to be moved aside with --overwrite).
bool check_output_settings(const QaJob& job, const json& now) {
  const bool has_rows = fs::exists(job.output) && fs::file_size(job.output) > 0;
  const std::string sp = settings_path(job.output);
  if (!has_rows || job.overwrite) return has_rows;
  LVX_CHECK(fs::exists(sp), "answers file '", job.output, "' has answers but no settings file '",
            sp,
            "' (written by another program or an older lvx): give --overwrite to answer every "
            "question again (the old answers move to ",
            job.output, ".old), or another --output");
  const json before = read_json_file(sp, "answers settings file");
  std::string diff;
  std::set<std::string> keys;
  for (const auto& [k, v] : now.items()) keys.insert(k);
  if (before.is_object())
    for (const auto& [k, v] : before.items()) keys.insert(k);
  for (const std::string& k : keys) {
    const json a = before.is_object() && before.contains(k) ? before[k] : json();
    const json b = now.contains(k) ? now[k] : json();
    if (a != b)
      diff += str(diff.empty() ? "" : "; ", k, " ", a.is_null() ? "unset" : dump(a), " there, ",
                  b.is_null() ? "unset" : dump(b), " now");
  }
  LVX_CHECK(diff.empty(), "answers file '", job.output, "' was written with other settings (", sp,
            "): ", diff,
            ". Give --overwrite to answer every question again (the old answers move to ",
            job.output, ".old), or another --output");
  return true;
}

void write_settings(const std::string& output, const json& settings) {
  const std::string sp = settings_path(output), tmp = sp + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << settings.dump(2, ' ', false, json::error_handler_t::replace) << "\n";
    f.flush();
    LVX_CHECK(f.good(), "cannot write '", tmp, "'");
  }
  fs::rename(tmp, sp);
}

}  // namespace

namespace {

// What every session holds beside its model: the tokenizer, preprocessing, stop tokens, context
// and the visual cache.
// A fresh content secret for this session's content keys (qa_media.h), drawn on rank 0 and
// given to every rank: no client can choose two videos of one key without it.
void share_content_secret(dist::ProcessGroup& pg) {
  at::Tensor secret = at::empty({192}, at::kByte);
  if (pg.rank() == 0) {
    std::random_device rd;
    uint8_t* p = secret.data_ptr<uint8_t>();
    for (int64_t i = 0; i < secret.numel(); ++i) p[i] = static_cast<uint8_t>(rd());
  }
  pg.broadcast(secret, 0);
  set_content_secret(
      std::string(reinterpret_cast<const char*>(secret.data_ptr<uint8_t>()), secret.numel()));
}

void finish_session(QaSession::State& s, int64_t cache_bytes) {
  share_content_secret(*s.pg);
  s.tok = std::make_unique<models::Tokenizer>(
      models::Tokenizer::from_file(s.job.model + "/tokenizer.json"));
  s.preprocess = family_preprocess(s.model->family(), s.model->planner_model().vision.image_size);
  s.stop = s.model->family().stop_tokens(*s.tok);
  s.context = model_context_length(s.job.model);
  s.cache = std::make_unique<VisualCache>(cache_bytes);
}

}  // namespace

QaSession::QaSession(const QaJob& job, std::shared_ptr<dist::ProcessGroup> pg, int64_t cache_bytes)
    : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.pg = std::move(pg);
  s.device = choose_device(job.device);
  s.job = job;  // --dtype auto resolved for this device (the plan and the weights)
  const std::string ck_dtype = checkpoint_dtype(job.model);
  s.job.plan.dtype = resolve_dtype(job.plan.dtype, s.device, ck_dtype);
  if (s.pg->rank() == 0)
    if (const std::string note = dtype_note(job.plan.dtype, s.device, ck_dtype, s.job.plan.dtype);
        !note.empty())
      std::cerr << "lvx: " << note << "\n";
  s.owned = models::load_model(job.model, dtype_of(s.job.plan.dtype, "--dtype"), s.device);
  if (!job.adapter.empty()) models::merge_adapter(*s.owned, job.adapter);  // --adapter (LoRA)
  s.model = s.owned.get();
  finish_session(s, cache_bytes);
}

QaSession::QaSession(const QaJob& job, std::shared_ptr<dist::ProcessGroup> pg, models::Model& model)
    : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.pg = std::move(pg);
  s.device = choose_device(job.device);
  s.job = job;
  LVX_CHECK(job.plan.dtype == "fp32" || job.plan.dtype == "bf16", "QaSession: the lent model's ",
            "dtype must be given as fp32 or bf16, got '", job.plan.dtype, "'");
  LVX_CHECK(job.adapter.empty(), "QaSession: a lent model is used as it is (no --adapter)");
  s.model = &model;
  finish_session(s, /*cache_bytes=*/0);
}

QaSession::~QaSession() = default;

PromptTokens QaSession::prompt(const QaRequest& req, int64_t frames) const {
  return chat_prompt(*s_, req, frames);
}
dist::ProcessGroup& QaSession::group() { return *s_->pg; }
const models::Model& QaSession::model() const { return *s_->model; }
void QaSession::batch_prompts(bool on) { s_->batch_prompts = on; }
const QaJob& QaSession::job() const { return s_->job; }
VisualCacheStats QaSession::cache_stats() const { return s_->cache->stats(); }

int64_t QaSession::cache_bytes_all() const { return s_->cache_bytes_all; }

json qa_settings(const QaJob& job) {
  std::error_code ec;
  const fs::path model = fs::weakly_canonical(job.model, ec);
  const bool sampling = job.generation.sampling.temperature > 0;
  auto opt = [](const auto& v) { return v ? json(*v) : json(); };
  json s = {{"model", ec ? job.model : model.string()},
            {"dtype", job.plan.dtype},
            {"fps", opt(job.fps)},
            {"num_frames", job.fps ? json() : json(job.num_frames.value_or(16))},
            {"start", opt(job.start)},
            {"end", opt(job.end)},
            {"max_new_tokens", job.generation.max_new_tokens},
            {"ignore_stop", job.ignore_stop},
            {"temperature", job.generation.sampling.temperature},
            {"top_p", sampling ? json(job.generation.sampling.top_p) : json()},
            {"seed", sampling ? json(job.generation.sampling.seed) : json()}};
  if (!job.adapter.empty()) {  // --adapter: the answers depend on it (absent: as before)
    const fs::path a = fs::weakly_canonical(job.adapter, ec);
    s["adapter"] = ec ? job.adapter : a.string();
  }
  return s;
}

void validate_qa_settings(const QaJob& job) {
  resolve_dtype(job.plan.dtype, at::Device(at::kCPU), "");
  check_device_option(job.device);  // counts: by the launcher and on each rank
  LVX_CHECK(fs::is_directory(job.model), job.model,
            ": not a directory (expected a checkpoint directory with config.json)");
  check_regular_file((fs::path(job.model) / "config.json").string(), "model config");
  check_model_files(job.model);
  planner_model(job.model);  // config.json names a known family
  LVX_CHECK(fs::exists(fs::path(job.model) / "tokenizer.json"), job.model,
            ": has no tokenizer.json (lvx qa builds the prompt with it)");
  check_regular_file((fs::path(job.model) / "tokenizer.json").string(), "tokenizer file");
  if (!job.adapter.empty())  // --adapter: PEFT's two files (read on the ranks)
    for (const char* f : {"adapter_config.json", "adapter_model.safetensors"})
      check_regular_file((fs::path(job.adapter) / f).string(), "LoRA adapter file (--adapter)");
  LVX_CHECK(!(job.fps && job.num_frames), "give --fps or --num-frames, not both");
  LVX_CHECK(!job.fps || (*job.fps > 0 && std::isfinite(*job.fps)), "--fps must be > 0, got ",
            job.fps.value_or(0));
  LVX_CHECK(!job.num_frames || *job.num_frames >= 1, "--num-frames must be >= 1");
  for (const auto& [flag, t] : {std::pair{"--start", job.start}, std::pair{"--end", job.end}})
    LVX_CHECK(!t || (std::isfinite(*t) && *t >= 0), flag,
              " must be a finite number of seconds >= 0, got ", t.value_or(0));
  LVX_CHECK(job.generation.max_new_tokens >= 1, "--max-new-tokens must be >= 1, got ",
            job.generation.max_new_tokens);
  check_sampling(job.generation.sampling);
  LVX_CHECK(!(job.start && job.end) || *job.start < *job.end, "--start (", job.start.value_or(0),
            ") must be before --end (", job.end.value_or(0), ")");
  if (!job.plan.strategies.empty() && job.plan.strategies != "auto")
    explicit_strategies(job.plan.strategies, 1);
}

void validate_qa_job(const QaJob& job) {
  validate_qa_settings(job);
  LVX_CHECK(job.options.empty() || (job.options.size() >= 2 && job.options.size() <= 26),
            "--options needs 2 to 26 '|'-separated options (letters A to Z), got ",
            job.options.size());
  if (!job.questions.empty()) {
    LVX_CHECK(job.video.empty() && job.question.empty(),
              "give --questions (a JSONL file) or --video and --question, not both");
    LVX_CHECK(fs::exists(job.questions), job.questions, ": no such file (--questions)");
    check_regular_file(job.questions, "questions file (--questions)");
    LVX_CHECK(!job.output.empty(), "--questions needs --output (a JSONL file of answers)");
    check_output_path(job.output, "answers file (--output)");
    const fs::path dir = fs::absolute(job.output).parent_path();
    LVX_CHECK(fs::is_directory(dir), job.output, ": folder ", dir.string(), " does not exist");
    check_output_settings(job, qa_settings(job));
    return;
  }
  LVX_CHECK(!job.video.empty(), "--video is required (or --questions FILE)");
  LVX_CHECK(fs::exists(job.video), job.video, ": no such video file");
  check_regular_file(job.video, "video (--video)");
  LVX_CHECK(job.question.find_first_not_of(" \t\r\n") != std::string::npos, "--question is empty");
}

namespace {

// One question (--video, --question): its answer streamed to stdout as it is generated, or its
// row as JSON (--json), on rank 0.
int answer_one(const QaJob& job, QaSession& session, dist::ProcessGroup& pg) {
  const int r = pg.rank();
  AnswerHooks print;
  print.on_text = [](const std::string& piece) { std::cout << piece << std::flush; };
  QaRequest req;
  req.item.id = "question";
  req.item.video = job.video;
  req.item.question = job.question;
  req.item.options = job.options;
  const json row = session.answer(req, job.json ? AnswerHooks{} : print);
  if (!job.json && r == 0 && !row.contains("error")) std::cout << "\n" << std::flush;
  LVX_CHECK(!row.contains("error"), row["error"].get<std::string>());
  if (r == 0 && job.json) std::cout << dump(row) << std::endl;
  if (r == 0 && !job.json)
    std::cerr << "[qa] " << row["frames"] << " frames on " << pg.world_size()
              << " ranks, time to first token " << row["timings"]["ttft_s"] << " s, "
              << row["timings"]["decode_per_token_s"] << " s per token, decode bytes/token "
              << row["bytes"]["decode_per_token"] << "\n";
  pg.barrier();
  return 0;
}

// The answers file before a batch (rank 0): an earlier one moved aside (--overwrite), a torn last
// line repaired, the run's settings written.
void prepare_answers_file(const QaJob& job, const json& settings, bool had_rows) {
  if (job.overwrite && had_rows) {
    // Never over an earlier .old: the first free of .old, .old.1, .old.2, ...
    std::string old = job.output + ".old";
    for (int k = 1; fs::exists(old); ++k) old = str(job.output, ".old.", k);
    fs::rename(job.output, old);
    std::cerr << "lvx qa: --overwrite: the previous answers moved to " << old << "\n";
  }
  const std::string torn = repair_torn_jsonl(job.output);
  if (!torn.empty())
    std::cerr << "lvx qa: " << job.output << ": its last line was torn (a run killed while "
              << "writing it): " << torn.size() << " bytes moved to " << job.output
              << ".torn; that question is asked again\n";
  write_settings(job.output, settings);
}

// A batch's counts, as rank 0 reports them at the end.
struct BatchTally {
  int64_t answered = 0, failed = 0, skipped = 0, scored = 0, correct = 0;
  void add(const json& row) {
    if (row.contains("error")) {
      ++failed;
      return;
    }
    ++answered;
    if (!row.contains("correct")) return;
    ++scored;
    correct += row["correct"].get<bool>() ? 1 : 0;
  }
  void report(const std::string& output) const {
    std::cerr << "[qa] answered " << answered << ", failed " << failed;
    if (skipped) std::cerr << ", already in " << output << " " << skipped;
    if (scored)
      std::cerr << "; accuracy " << correct << "/" << scored << " = "
                << 100.0 * static_cast<double>(correct) / static_cast<double>(scored) << "%";
    std::cerr << "\n";
  }
};

// Rank 0's line for one row: the answer (or error), and whether it was right.
void report_row(size_t i, size_t n, const QaLine& l, const json& row) {
  std::cerr << "[qa " << i + 1 << "/" << n << "] " << l.item.id << ": "
            << (row.contains("error") ? "error: " + row["error"].get<std::string>()
                                      : dump(row["response"]))
            << (row.contains("correct") ? (row["correct"].get<bool>() ? " (correct)" : " (wrong)")
                                        : "")
            << "\n";
}

// A batch (--questions FILE): every row not yet in the answers file answered in order and
// appended (rank 0), a row that cannot be read answered with its error.
int answer_batch(const QaJob& job, QaSession& session, dist::ProcessGroup& pg) {
  const int r = pg.rank();
  // A question (and its options) may be long: rows up to 64 MiB.
  const std::vector<QaLine> lines = read_qa_rows(job.questions, "questions file",
                                                 /*need_answer=*/false, uint64_t{64} << 20);
  check_output_path(job.output, "answers file (--output)");
  const json settings = qa_settings(job);
  const bool had_rows = check_output_settings(job, settings);  // every rank, before any write
  pg.barrier();
  if (r == 0) prepare_answers_file(job, settings, had_rows);
  pg.barrier();
  const std::set<std::string> done = answered_ids(job.output, r);
  pg.barrier();
  std::ofstream out;
  if (r == 0) {
    out.open(job.output, std::ios::app);
    LVX_CHECK(out.good(), job.output, ": cannot open for writing");
  }
  BatchTally tally;
  for (size_t i = 0; i < lines.size(); ++i) {
    const QaLine& l = lines[i];
    if (done.count(l.item.id)) {
      ++tally.skipped;
      continue;
    }
    json row;
    if (!l.error.empty()) {
      row = {{"id", l.item.id}, {"line", l.line}, {"error", l.error}};
    } else {
      QaRequest req;
      req.item = l.item;
      row = session.answer(req);
    }
    tally.add(row);
    if (r != 0) continue;
    out << dump(row) << "\n" << std::flush;
    report_row(i, lines.size(), l, row);
  }
  if (r == 0) tally.report(job.output);
  pg.barrier();
  return 0;
}

}  // namespace

int run_qa_rank(const QaJob& job) {
  validate_qa_job(job);  // also under an outer launcher (torchrun, lvx launch): every rank alike
  auto pg = dist::ProcessGroup::from_env();
  QaSession session(job, pg);
  return job.questions.empty() ? answer_one(job, session, *pg) : answer_batch(job, session, *pg);
}

}  // namespace lvx::runtime
