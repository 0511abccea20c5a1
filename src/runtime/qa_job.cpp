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
#include <set>

#include "models/lora.h"
#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/dist/process_group.h"
#include "src/runtime/device.h"
#include "src/runtime/logprobs_json.h"
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

// Every rank's error for one question (empty: fine), so that all ranks skip it together.
// Returns the first failed rank's message, naming it.
std::string agree_on_error(dist::ProcessGroup& pg, const std::string& error) {
  const std::vector<std::string> all = dist::gather_errors(pg, error);
  for (int r = 0; r < pg.world_size(); ++r) {
    const std::string& msg = all[static_cast<size_t>(r)];
    if (!msg.empty()) return pg.world_size() > 1 ? str("rank ", r, ": ", msg) : msg;
  }
  return "";
}

// JSON text of a row. A question or path with invalid UTF-8 (JSON parsing keeps such bytes) is
// written with U+FFFD in their place instead of failing the whole batch.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// An id the tokenizer can decode. A model's embedding may have more rows than the tokenizer has
// tokens (padding, as Qwen's): a sampled or --ignore-stop id among them has no text (dropped, as
// tokenizers' decode does) instead of failing the answer.
bool known_id(const models::Tokenizer& tok, int64_t id) {
  if (id < 0 || id >= tok.id_limit()) return false;
  try {
    tok.id_to_token(id);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// The answer's text as tokens arrive, given to `sink` piece by piece; an incomplete UTF-8
// character waits for its rest.
class TextStream {
 public:
  TextStream(const models::Tokenizer& tok, std::vector<int64_t> stop,
             std::function<void(const std::string&)> sink)
      : tok_(tok), stop_(std::move(stop)), sink_(std::move(sink)) {}
  void add(int64_t id) {
    if (done_ || std::find(stop_.begin(), stop_.end(), id) != stop_.end()) {
      done_ = true;
      return;
    }
    if (!known_id(tok_, id)) return;
    ids_.push_back(id);
    const std::string text = tok_.decode(ids_, /*skip_special_tokens=*/true);
    if (text.size() >= 3 && text.compare(text.size() - 3, 3, "\xEF\xBF\xBD") == 0) return;
    if (text.size() > printed_ && text.compare(0, printed_, text, 0, printed_) == 0) {
      sink_(text.substr(printed_));
      printed_ = text.size();
    }
  }

 private:
  const models::Tokenizer& tok_;
  std::vector<int64_t> stop_;
  std::function<void(const std::string&)> sink_;
  std::vector<int64_t> ids_;
  size_t printed_ = 0;
  bool done_ = false;
};

// This rank's share of `files` (one frame each, in order): each decoded as a one-frame video and
// preprocessed like a video's frames. indices and pts are the frames' positions in the list.
video::FrameBatch decode_images(const std::vector<std::string>& files,
                                const video::ShardSpec& shard,
                                const video::PreprocessConfig& preprocess) {
  const int64_t m = static_cast<int64_t>(files.size());
  const std::vector<int64_t> mine = video::shard_positions(m, shard);
  std::vector<at::Tensor> frames;
  for (int64_t i : mine) {
    check_regular_file(files[static_cast<size_t>(i)], "frame image");
    video::SampleSpec one;
    one.num_frames = 1;
    video::FrameBatch f;
    try {
      f = video::decode_video(files[static_cast<size_t>(i)], one, {0, 1}, preprocess);
    } catch (const std::exception& ex) {
      LVX_FAIL("frame image ", i, " of ", m, ": ", ex.what());
    }
    LVX_CHECK(f.frames.defined() && f.frames.size(0) == 1, "frame image ", i, " of ", m,
              ": decoded no frame");
    frames.push_back(f.frames);
  }
  video::FrameBatch out;
  out.indices = at::tensor(mine, at::kLong);
  out.pts = out.indices.to(at::kDouble);
  out.frames = frames.empty() ? at::Tensor() : at::cat(frames, 0);
  out.report.sampled_total = m;
  out.report.shard = mine;
  return out;
}

// XXH3 of a file's content, hashed again only when the file may have changed: the hash is kept
// with the file's device, inode, size, modification and status-change times (the kernel sets
// ctime on every write, and no call sets it back), all of which must match to reuse it. A
// one-hour video is hashed once, not on every question.
std::string content_hash(const std::string& path) {
  struct Known {
    struct stat st;
    std::string hash;
  };
  static std::mutex mu;
  static std::map<std::string, Known> known;
  struct stat st {};
  LVX_CHECK(::stat(path.c_str(), &st) == 0, path, ": cannot stat: ", std::strerror(errno));
  auto same = [](const struct stat& a, const struct stat& b) {
    return a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_size == b.st_size &&
           a.st_mtim.tv_sec == b.st_mtim.tv_sec && a.st_mtim.tv_nsec == b.st_mtim.tv_nsec &&
           a.st_ctim.tv_sec == b.st_ctim.tv_sec && a.st_ctim.tv_nsec == b.st_ctim.tv_nsec;
  };
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = known.find(path);
    if (it != known.end() && same(it->second.st, st)) return it->second.hash;
  }
  const std::string hash = file_xxh3(path);
  struct stat after {};
  if (::stat(path.c_str(), &after) == 0 && same(st, after)) {  // unchanged while hashed
    std::lock_guard<std::mutex> lock(mu);
    if (known.size() > 4096) known.clear();
    known[path] = {st, hash};
  }
  return hash;
}

video::DecodeOptions decode_options(const QaRequest& req) {
  video::DecodeOptions o;
  o.index_cache = req.cache_frame_index;
  return o;
}

// The visual cache's key of a request on this rank: the content's hash (always: a client's
// video_id names a video but never stands in for its bytes, so no id reaches another client's
// features or a stale entry), the sampling, the preprocessing, the dtype and the rank's place.
// The content hash of the request's video: the one it names (media_hash), or its file's.
std::string video_hash(const QaRequest& req) {
  return req.item.video.empty() ? req.media_hash : content_hash(req.item.video);
}

std::string visual_key(const QaRequest& req, const video::SampleSpec& spec,
                       const video::PreprocessConfig& pre, const std::string& dtype, int rank,
                       int world) {
  std::string source;
  if (!req.image_files.empty()) {
    source = "frames:";
    for (const std::string& f : req.image_files) source += file_xxh3(f);
  } else {
    source = "video:" + video_hash(req);
  }
  auto opt = [](const auto& v) { return v ? json(*v) : json(); };
  const json k{{"source", source},
               {"fps", opt(spec.fps)},
               {"num_frames", opt(spec.num_frames)},
               {"start", opt(spec.start)},
               {"end", opt(spec.end)},
               {"image_size", pre.image_size},
               {"resize", video::to_string(pre.resize)},
               {"mean", pre.mean},
               {"std", pre.std},
               {"dtype", dtype},
               {"rank", rank},
               {"world", world}};
  return k.dump();
}

}  // namespace

struct QaSession::State {
  QaJob job;  // its plan.dtype resolved (fp32 | bf16)
  std::shared_ptr<dist::ProcessGroup> pg;
  at::Device device{at::kCPU};  // the model's: frames go there once, after preprocessing
  std::unique_ptr<models::Model> owned;  // the model the session loaded, if it did
  models::Model* model = nullptr;        // owned, or one lent by the caller (lvx finetune)
  std::unique_ptr<models::Tokenizer> tok;
  video::PreprocessConfig preprocess;
  std::vector<int64_t> stop;
  int64_t context = 0;  // the model's context length (0: unknown)
  std::unique_ptr<VisualCache> cache;
  bool batch_prompts = false;  // QaSession::batch_prompts
};

namespace {

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
void finish_session(QaSession::State& s, int64_t cache_bytes) {
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
  const std::string ck_dtype = planner_model(job.model).dtype;
  s.job.plan.dtype = resolve_dtype(job.plan.dtype, s.device,
                                   ck_dtype == "fp32"   ? "float32"
                                   : ck_dtype == "fp16" ? "float16"
                                                        : "bfloat16");
  s.owned = models::load_model(job.model, dtype_of(s.job.plan.dtype, "--dtype"), s.device);
  if (!job.adapter.empty()) models::merge_adapter(*s.owned, job.adapter);  // --adapter (LoRA)
  s.model = s.owned.get();
  finish_session(s, cache_bytes);
}

QaSession::QaSession(const QaJob& job, std::shared_ptr<dist::ProcessGroup> pg,
                     models::Model& model)
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
  return s_->model->family().prompt_chat(*s_->tok, req.item.system, req.earlier,
                                         question_text(req.item), frames);
}
dist::ProcessGroup& QaSession::group() { return *s_->pg; }
void QaSession::batch_prompts(bool on) { s_->batch_prompts = on; }
const QaJob& QaSession::job() const { return s_->job; }
VisualCacheStats QaSession::cache_stats() const { return s_->cache->stats(); }

// One question being answered (QaSession::start .. finish): what answer() keeps between the
// prefill and the row. Heap-held, so the generation's hooks may point into it.
struct QaAnswer {
  QaRequest req;
  AnswerHooks hooks;
  json row;
  bool failed = false;  // the row already holds its "error"
  clock::time_point t_start;
  double video_s = 0;
  std::shared_ptr<const VisualEntry> cached;
  std::string key;
  std::string media_hash;  // the video's content hash, when the request asks for it
  video::FrameBatch frames;
  int64_t m = 0;  // frames sampled over all ranks
  std::vector<std::string> events;
  PromptTokens prompt;
  at::Tensor ids;  // prompt.ids as int64 [1, L] (host)
  models::Parallel par;
  std::vector<int64_t> prefix_ids;
  std::string plan_key;
  std::shared_ptr<const VisualEntry::Prefix> reuse, made;
  models::LocalMedia encoded;  // filled by the prefill on a cache miss
  std::unique_ptr<TextStream> text;
  std::unique_ptr<Generation> gen;
};

void QaAnswerDeleter::operator()(QaAnswer* a) const { delete a; }
bool QaSession::done(const QaAnswer& a) const { return a.failed || a.gen->done(); }

namespace {

// This rank's share of the request's frames: from the visual cache (nothing decoded or
// encoded), or decoded here; an error of any rank becomes the row's error on every rank.
void take_frames(QaSession::State& cx, QaAnswer& a) {
  const QaRequest& req = a.req;
  const QaItem& item = req.item;
  dist::ProcessGroup& pg = *cx.pg;
  const int n = pg.world_size(), r = pg.rank();
  video::SampleSpec spec;
  const bool own_sampling = req.fps || req.num_frames;
  const std::optional<double> fps = own_sampling ? req.fps : cx.job.fps;
  const std::optional<int64_t> num_frames = own_sampling ? req.num_frames : cx.job.num_frames;
  spec.fps = fps;
  spec.num_frames = fps ? std::nullopt : std::optional<int64_t>(num_frames.value_or(16));
  spec.start = item.start ? item.start : cx.job.start;
  spec.end = item.end ? item.end : cx.job.end;
  if (!req.image_files.empty()) spec = video::SampleSpec{};  // every frame given, in order
  std::string error;
  try {
    const bool named = req.image_files.empty() && item.video.empty() && !req.media_hash.empty();
    if (req.image_files.empty() && !named) {
      LVX_CHECK(fs::exists(item.video), item.video, ": no such video file");
      check_regular_file(item.video, "video");  // a FIFO would block FFmpeg's open
    }
    if (cx.cache->enabled()) {
      a.key = visual_key(req, spec, cx.preprocess, cx.job.plan.dtype, r, n);
      a.cached = cx.cache->find(a.key);
    }
    LVX_CHECK(a.cached || !named,
              "the video of this uuid is not in the visual cache with these frame settings (it "
              "was evicted, asked with other frames, or the server keeps none): send the video "
              "again with its uuid");
    if (req.return_media_hash && req.image_files.empty()) a.media_hash = video_hash(req);
    if (!a.cached)
      a.frames = req.image_files.empty()
                     ? video::decode_video(item.video, spec, {r, n}, cx.preprocess,
                                           decode_options(req))
                     : decode_images(req.image_files, {r, n}, cx.preprocess);
  } catch (const std::exception& e) {
    error = e.what();
  }
  error = agree_on_error(pg, error);
  if (!error.empty()) {
    a.row["error"] = error;
    a.failed = true;
    return;
  }
  a.video_s = since(a.t_start);
  a.m = a.cached ? a.cached->sampled_total : a.frames.report.sampled_total;
  a.events = a.cached ? a.cached->events : a.frames.report.events;
}

// The prompt (every rank builds the same, so all skip one that cannot be tokenized or does not
// fit together), and the plan for it.
void take_prompt(QaSession& session, QaSession::State& cx, QaAnswer& a) {
  try {
    a.prompt = session.prompt(a.req, a.m);
  } catch (const Error& e) {
    a.row["error"] = e.what();
    a.failed = true;
    return;
  }
  const int64_t prompt_len = static_cast<int64_t>(a.prompt.ids.size());
  if (cx.context > 0 && prompt_len >= cx.context) {
    a.row["error"] = str("the prompt has ", prompt_len, " tokens (", a.m,
                         " frames and the question), more than the model's context of ",
                         cx.context, " tokens leaves room for: ask a shorter question or sample "
                         "fewer frames");
    a.failed = true;
    return;
  }
  const int r = cx.pg->rank();
  if (r == 0)
    for (const auto& e : a.events)
      std::cerr << "[qa] " << (a.req.item.video.empty() ? "frames" : a.req.item.video) << ": " << e
                << "\n";
  a.ids = at::tensor(a.prompt.ids, at::kLong).unsqueeze(0);
  std::string plan_text;
  a.par = plan_layers(*cx.model, a.ids, cx.pg->world_size(), cx.job.plan, &plan_text);
  a.par.pg = cx.pg;
  if (cx.job.print_plan && r == 0)
    std::cerr << plan_text << "\n" << describe(a.par, cx.model) << "\n";
}

// The generation's options: the request's or the job's, the context, the stop tokens, and the
// prompt prefix kept with the video's entry (a later question whose prompt starts the same, run
// with the same plan, starts from its state on every rank: one flag, all-reduced).
GenerateOptions generation_options(QaSession::State& cx, QaAnswer& a) {
  GenerateOptions g = a.req.generation ? *a.req.generation : cx.job.generation;
  g.max_length = cx.context;
  if (!cx.job.ignore_stop) g.stop = cx.stop;
  g.stop_requested = a.hooks.stop_requested;
  g.defer_tail = cx.batch_prompts;
  const int64_t split = prompt_prefix(a.ids, cx.model->media_token_id());
  a.prefix_ids.assign(a.prompt.ids.begin(), a.prompt.ids.begin() + split);
  a.plan_key = describe(a.par);
  if (split > 0 && cx.cache->enabled()) {
    const bool mine = a.cached && a.cached->prefix && a.cached->prefix->ids == a.prefix_ids &&
                      a.cached->prefix->plan == a.plan_key;
    at::Tensor all = at::full({1}, mine ? 1 : 0, at::kLong);
    cx.pg->all_reduce(all, dist::ReduceOp::kMin);
    if (all.item<int64_t>() == 1) a.reuse = a.cached->prefix;
    QaAnswer* ap = &a;
    g.cached_prefix = [ap]() -> const models::DecodeCache* {
      return ap->reuse ? &ap->reuse->state : nullptr;
    };
    g.store_prefix = [ap](const models::DecodeCache& state) {
      ap->made = std::make_shared<const VisualEntry::Prefix>(
          VisualEntry::Prefix{ap->prefix_ids, ap->plan_key, state});
    };
  }
  return g;
}

// The video's entry in the visual cache after a prefill: new on a miss, or the cached one with
// the prefix this prompt made (another system message, plan or frame count replaces it).
void keep_visual(QaSession::State& cx, QaAnswer& a) {
  if (!a.cached && cx.cache->enabled() && a.encoded.features.defined()) {
    auto entry = std::make_shared<VisualEntry>();
    entry->media = a.encoded;
    entry->sampled_total = a.m;
    entry->indices = a.frames.indices;
    entry->pts = a.frames.pts;
    entry->events = a.frames.report.events;
    entry->prefix = a.made;
    cx.cache->put(a.key, std::move(entry));
  } else if (a.cached && a.made) {
    auto entry = std::make_shared<VisualEntry>(*a.cached);
    entry->prefix = a.made;
    cx.cache->put(a.key, std::move(entry));
  }
}

}  // namespace

QaAnswerPtr QaSession::start(const QaRequest& req, const AnswerHooks& hooks) {
  State& cx = *s_;
  QaAnswerPtr a(new QaAnswer);
  a->req = req;
  a->hooks = hooks;
  const QaItem& item = req.item;
  a->row = json{{"id", item.id}, {"video", item.video}, {"question", item.question}};
  if (!req.image_files.empty()) a->row["video"] = json();
  if (!item.options.empty()) a->row["options"] = item.options;
  if (!item.answer.empty()) a->row["answer"] = item.answer;
  a->t_start = clock::now();
  take_frames(cx, *a);
  if (a->failed) return a;
  take_prompt(*this, cx, *a);
  if (a->failed) return a;
  const std::function<void(const std::string&)> sink =
      hooks.on_text ? hooks.on_text : [](const std::string&) {};
  a->text = std::make_unique<TextStream>(*cx.tok, cx.stop, sink);
  const GenerateOptions g = generation_options(cx, *a);
  // Frames go to the device once, after preprocessing; the prompt's ids stay host metadata.
  models::ModelInputs in{a->ids, at::Tensor(), /*pixels_local=*/true, {}};
  if (a->cached) {
    a->encoded = a->cached->media;
    in.media = &a->encoded;
  } else {
    in.pixel_values = a->frames.frames.defined() ? a->frames.frames.to(cx.device) : at::Tensor();
    if (cx.cache->enabled()) in.media = &a->encoded;
  }
  a->gen = std::make_unique<Generation>(*cx.model, in, a->par, g);
  keep_visual(cx, *a);
  return a;
}

void QaSession::step(const std::vector<QaAnswer*>& answers) {
  State& cx = *s_;
  const int r = cx.pg->rank();
  std::vector<Generation*> gens;
  std::vector<std::function<void(const at::Tensor&)>> on_token;
  for (QaAnswer* a : answers) {
    gens.push_back(a->gen.get());
    TextStream* text = a->text.get();
    const bool streams = static_cast<bool>(a->hooks.on_text);
    const Generation* gen = a->gen.get();
    const models::Tokenizer* tok = cx.tok.get();
    const std::vector<int64_t>* stop = &cx.stop;
    const auto& on_logprob = a->hooks.on_logprob;
    on_token.push_back([text, r, streams, gen, tok, stop, &on_logprob](const at::Tensor& next) {
      if (r != 0) return;  // rank 0 streams the text and the log-probabilities
      const int64_t id = next[0].item<int64_t>();
      if (streams) text->add(id);
      // The completion tokens' (the row's "logprobs"): not the stop token's.
      const bool stops = std::find(stop->begin(), stop->end(), id) != stop->end();
      if (on_logprob && !stops && !gen->logprobs().empty())
        on_logprob(logprob_json(*tok, gen->logprobs().back()));
    });
  }
  step_together(gens, *cx.model, answers.front()->par, on_token);
}

json QaSession::finish(QaAnswer& a) {
  if (a.failed) return a.row;
  State& cx = *s_;
  dist::ProcessGroup& pg = *cx.pg;
  const int n = pg.world_size(), r = pg.rank();
  const GenerateResult out = a.gen->finish();
  std::vector<int64_t> answer_ids;
  int64_t completion_tokens = 0;
  bool stop_token = false;
  for (int64_t i = 0; i < out.tokens.size(1); ++i) {
    const int64_t id = out.tokens[0][i].item<int64_t>();
    if (std::find(cx.stop.begin(), cx.stop.end(), id) != cx.stop.end()) {
      stop_token = true;
      break;
    }
    ++completion_tokens;
    if (known_id(*cx.tok, id)) answer_ids.push_back(id);
  }
  const std::string response = cx.tok->decode(answer_ids, /*skip_special_tokens=*/true);

  // The slowest rank's timings; every rank's bytes; every rank's frames in sampled order.
  double per_token = 0;
  for (double t : out.token_seconds) per_token += t;
  if (!out.token_seconds.empty()) per_token /= static_cast<double>(out.token_seconds.size());
  at::Tensor times = at::tensor(
      {a.video_s, out.encode_seconds, out.prefill_seconds, per_token, since(a.t_start)},
      at::kDouble);
  pg.all_reduce(times, dist::ReduceOp::kMax);
  const VisualCacheStats cs = cx.cache->stats();
  at::Tensor bytes =
      at::tensor({out.prefill_bytes_sent, out.decode_bytes_sent, int64_t{a.cached ? 1 : 0},
                  int64_t{!a.cached && cx.cache->enabled()}, cs.bytes},
                 at::kLong);
  pg.all_reduce(bytes);
  const attention::Layout frames_layout{attention::LayoutKind::kStriped, a.m, n};
  auto in_order = [&](const at::Tensor& local) {
    const at::Tensor all = pg.all_gather(local, frames_layout.sizes());
    return all.index_select(0, at::argsort(frames_layout.gathered_positions()));
  };
  const at::Tensor indices = in_order(a.cached ? a.cached->indices : a.frames.indices);
  const at::Tensor pts = in_order(a.cached ? a.cached->pts : a.frames.pts);

  json& row = a.row;
  const QaItem& item = a.req.item;
  row["response"] = response;
  row["parsed_answer"] = parse_answer(item, response);
  if (!item.answer.empty()) row["correct"] = row["parsed_answer"] == expected_answer(item);
  row["frames"] = a.m;
  row["frame_indices"] = std::vector<int64_t>(indices.data_ptr<int64_t>(),
                                              indices.data_ptr<int64_t>() + indices.numel());
  row["pts_seconds"] =
      std::vector<double>(pts.data_ptr<double>(), pts.data_ptr<double>() + pts.numel());
  row["prompt_tokens"] = static_cast<int64_t>(a.prompt.ids.size());
  if (a.req.return_prompt_ids) row["prompt_ids"] = a.prompt.ids;
  if (!a.media_hash.empty()) row["media_hash"] = a.media_hash;
  if (a.gen->options().logprobs >= 0) {  // the completion tokens' (before the stop token)
    row["logprobs"] = json::array();
    for (int64_t i = 0; i < completion_tokens; ++i)
      row["logprobs"].push_back(logprob_json(*cx.tok, out.logprobs[static_cast<size_t>(i)]));
  }
  row["new_tokens"] = out.tokens.size(1);
  row["completion_tokens"] = completion_tokens;
  row["finish_reason"] = stop_token || out.stopped ? "stop" : "length";
  if (out.hit_context) {
    row["stopped_at_context"] = cx.context;
    if (r == 0)
      std::cerr << "[qa] " << item.id << ": generation stopped after " << out.tokens.size(1)
                << " tokens: the model's context of " << cx.context << " tokens is full\n";
  }
  if (!a.events.empty()) row["video_events"] = a.events;
  row["ranks"] = n;
  row["plan"] = describe(a.par, cx.model);
  const double ttft = times[0].item<double>() + times[2].item<double>();
  row["timings"] = {
      {"video_decode_s", times[0].item<double>()},     {"encode_s", times[1].item<double>()},
      {"prefill_s", times[2].item<double>()},          {"ttft_s", ttft},
      {"decode_per_token_s", times[3].item<double>()}, {"total_s", times[4].item<double>()}};
  const int64_t steps = std::max<int64_t>(1, out.tokens.size(1) - 1);
  row["bytes"] = {{"prefill", bytes[0].item<int64_t>()},
                  {"decode", bytes[1].item<int64_t>()},
                  {"decode_per_token", bytes[1].item<int64_t>() / steps}};
  if (cx.cache->enabled())
    row["visual_cache"] = {{"hits", bytes[2].item<int64_t>()},
                           {"misses", bytes[3].item<int64_t>()},
                           {"bytes", bytes[4].item<int64_t>()},
                           {"prefix_tokens", out.prefix_tokens},
                           {"prefix_reused", out.prefix_reused}};
  return row;
}

json QaSession::answer(const QaRequest& req, const AnswerHooks& hooks) {
  const QaAnswerPtr a = start(req, hooks);
  while (!done(*a)) step({a.get()});
  return finish(*a);
}

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

int run_qa_rank(const QaJob& job) {
  validate_qa_job(job);  // also under an outer launcher (torchrun, lvx launch): every rank alike
  auto pg = dist::ProcessGroup::from_env();
  const int r = pg->rank();
  QaSession session(job, pg);
  // A single question's answer streams to stdout as it is generated (rank 0).
  AnswerHooks print;
  print.on_text = [](const std::string& piece) { std::cout << piece << std::flush; };

  if (job.questions.empty()) {  // one question
    QaItem item;
    item.id = "question";
    item.video = job.video;
    item.question = job.question;
    item.options = job.options;
    QaRequest req;
    req.item = item;
    const json row = session.answer(req, job.json ? AnswerHooks{} : print);
    if (!job.json && r == 0 && !row.contains("error")) std::cout << "\n" << std::flush;
    LVX_CHECK(!row.contains("error"), row["error"].get<std::string>());
    if (r == 0 && job.json) std::cout << dump(row) << std::endl;
    if (r == 0 && !job.json)
      std::cerr << "[qa] " << row["frames"] << " frames on " << pg->world_size()
                << " ranks, time to first token " << row["timings"]["ttft_s"] << " s, "
                << row["timings"]["decode_per_token_s"] << " s per token, decode bytes/token "
                << row["bytes"]["decode_per_token"] << "\n";
    pg->barrier();
    return 0;
  }

  // A question (and its options) may be long: rows up to 64 MiB.
  const std::vector<QaLine> lines = read_qa_rows(job.questions, "questions file",
                                                 /*need_answer=*/false, uint64_t{64} << 20);
  check_output_path(job.output, "answers file (--output)");
  const json settings = qa_settings(job);
  const bool had_rows = check_output_settings(job, settings);  // every rank, before any write
  pg->barrier();
  if (r == 0) {
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
  pg->barrier();
  const std::set<std::string> done = answered_ids(job.output, r);
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
      QaRequest req;
      req.item = l.item;
      row = session.answer(req);
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
      out << dump(row) << "\n" << std::flush;
      std::cerr << "[qa " << i + 1 << "/" << lines.size() << "] " << l.item.id << ": "
                << (row.contains("error") ? "error: " + row["error"].get<std::string>()
                                          : dump(row["response"]))
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
