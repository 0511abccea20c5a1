// One question's answer in parts (QaSession::begin .. finish, qa_job.h): what lvx qa runs for
// each question and lvx serve's scheduler drives for many at once.
//   begin    (this rank alone) finds the video in the visual cache, or decodes this rank's frames,
//            builds the prompt and its plan and, when the prompt is prefilled in chunks, encodes
//            the frames and makes their visual K/V (Model::prefill_media): on a worker thread
//            when there are frames to decode, so the ranks' lockstep (lvx serve's decode steps)
//            goes on meanwhile;
//   advance  (collective) waits for that worker, agrees on errors and on a kept prompt prefix,
//            and starts the generation (its prompt whole, or its first chunk to come);
//   prefill_next (collective) one chunk of a prompt prefilled in chunks;
//   step     (collective) one token of several answers, one decode step for all;
//   finish   (collective) the row.
// Each part runs under c10::InferenceMode (the worker too): its tensors carry no autograd
// bookkeeping (version counters, view tracking), which on the small per-token ops of a decode
// step is a measurable part of the time; they are only ever read by later parts, also in it.
// Just over 600 lines, not split: every part reads and writes QaAnswer, which is this file's own
// struct (qa_job.h declares it only); a split would first move it into a shared header.
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <future>
#include <iostream>

#include "src/common/error.h"
#include "src/common/files.h"
#include "src/runtime/logprobs_json.h"
#include "src/runtime/model_description.h"
#include "src/runtime/qa_media.h"
#include "src/runtime/qa_session_state.h"
#include "src/runtime/question_plan.h"
#include "src/runtime/video_qa.h"

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

}  // namespace

// One question being answered (QaSession::begin .. finish): what answer() keeps between the
// prefill and the row. Heap-held, so the generation's hooks and the worker may point into it.
struct QaAnswer {
  QaRequest req;
  AnswerHooks hooks;
  json row;
  bool failed = false;     // the row already holds its "error" (the same on every rank)
  bool advanced = false;   // QaSession::advance ran: the ranks agree on it from then on
  std::string error;       // this rank's error of the media, before the ranks agree (advance)
  std::future<void> work;  // this rank's worker (begin), when it has one
  clock::time_point t_start;
  double video_s = 0;
  double media_s = 0;  // the worker's encoding and visual K/V (prefill_media), part of the prompt's
  video::SampleSpec spec;
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
  models::LocalMedia encoded;                              // filled by the prefill on a cache miss
  std::shared_ptr<const models::DecodeCache> media_state;  // the worker's prefill_media
  std::unique_ptr<TextStream> text;
  std::unique_ptr<Generation> gen;
};

void QaAnswerDeleter::operator()(QaAnswer* a) const { delete a; }

namespace {

// The request's sampling of its video (its own frame settings, or the job's).
video::SampleSpec sample_spec(const QaSession::State& cx, const QaRequest& req) {
  if (!req.image_files.empty()) return video::SampleSpec{};  // every frame given, in order
  video::SampleSpec spec;
  const bool own_sampling = req.fps || req.num_frames;
  const std::optional<double> fps = own_sampling ? req.fps : cx.job.fps;
  const std::optional<int64_t> num_frames = own_sampling ? req.num_frames : cx.job.num_frames;
  spec.fps = fps;
  spec.num_frames = fps ? std::nullopt : std::optional<int64_t>(num_frames.value_or(16));
  spec.start = req.item.start ? req.item.start : cx.job.start;
  spec.end = req.item.end ? req.item.end : cx.job.end;
  spec.max_frames = cx.job.max_frames;
  return spec;
}

// The video checked and looked up in the visual cache (its content hash); this rank's error in
// a.error (the ranks agree in advance).
void look_up(QaSession::State& cx, QaAnswer& a) {
  const QaRequest& req = a.req;
  const QaItem& item = req.item;
  const int n = cx.pg->world_size(), r = cx.pg->rank();
  a.spec = sample_spec(cx, req);
  if (req.text_only) return;  // nothing to find
  try {
    const bool named = req.image_files.empty() && item.video.empty() && !req.media_hash.empty();
    if (req.image_files.empty() && !named) {
      LVX_CHECK(fs::exists(item.video), item.video, ": no such video file");
      check_regular_file(item.video, "video");  // a FIFO would block FFmpeg's open
    }
    if (cx.cache->enabled()) {
      a.key = visual_key(req, a.spec, cx.preprocess, cx.job.plan.dtype, r, n);
      a.cached = cx.cache->find(a.key);
    }
    LVX_CHECK(a.cached || !named,
              "the video of this uuid is not in the visual cache with these frame settings (it "
              "was evicted, asked with other frames, or the server keeps none): send the video "
              "again with its uuid");
    if (req.return_media_hash && req.image_files.empty()) a.media_hash = video_hash(req);
  } catch (const std::exception& e) {
    a.error = e.what();
  }
}

// This rank's share of the request's frames, decoded (a cache hit decodes nothing).
void decode_frames(QaSession::State& cx, QaAnswer& a) {
  const int n = cx.pg->world_size(), r = cx.pg->rank();
  if (a.req.text_only) {  // no frame: an empty share on every rank
    a.frames.indices = at::empty({0}, at::kLong);
    a.frames.pts = at::empty({0}, at::kDouble);
    a.video_s = since(a.t_start);
    a.m = 0;
    return;
  }
  try {
    if (!a.cached)
      a.frames = a.req.image_files.empty()
                     ? video::decode_video(a.req.item.video, a.spec, {r, n}, cx.preprocess,
                                           decode_options(a.req))
                     : decode_images(a.req.image_files, {r, n}, cx.preprocess);
  } catch (const std::exception& e) {
    a.error = e.what();
    return;
  }
  a.video_s = since(a.t_start);
  a.m = a.cached ? a.cached->sampled_total : a.frames.report.sampled_total;
  a.events = a.cached ? a.cached->events : a.frames.report.events;
}

// The prompt (every rank builds the same, so all skip one that cannot be tokenized or does not
// fit together), and the plan for it.
void take_prompt(QaSession::State& cx, QaAnswer& a) {
  try {
    a.prompt = chat_prompt(cx, a.req, a.m);
  } catch (const Error& e) {
    a.row["error"] = e.what();
    a.failed = true;
    return;
  }
  const int64_t prompt_len = static_cast<int64_t>(a.prompt.ids.size());
  if (cx.context > 0 && prompt_len >= cx.context) {
    a.row["error"] = str("the prompt has ", prompt_len, " tokens (", a.m,
                         " frames and the question), more than the model's context of ", cx.context,
                         " tokens leaves room for: ask a shorter question or sample "
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
  a.par.side_by_side = cx.job.side_by_side;
  a.par.lead_threads = cx.job.lead_threads;
  if (cx.job.print_plan && r == 0)
    std::cerr << plan_text << "\n"
              << describe(a.par, cx.model) << "\n"
              << decode_price_text(cx.job.model, *cx.model, cx.job.plan, a.m, a.ids.size(1),
                                   cx.pg->world_size());
}

// A miss whose prompt is prefilled in chunks: this rank's frames encoded and their visual K/V
// made now (Model::prefill_media), off the ranks' lockstep.
void prepare_media(QaSession::State& cx, QaAnswer& a) {
  const GenerateOptions& g = a.req.generation ? *a.req.generation : cx.job.generation;
  const int64_t split = prompt_prefix(a.ids, cx.model->media_token_id());
  if (a.cached || !prefills_in_chunks(*cx.model, g, split)) return;
  const auto t0 = clock::now();
  try {
    models::ModelInputs head{a.ids.narrow(1, 0, split), at::Tensor(), /*pixels_local=*/true, {}};
    if (a.frames.frames.defined()) head.pixel_values = a.frames.frames.to(cx.device);
    if (cx.cache->enabled()) head.media = &a.encoded;
    auto state = std::make_shared<models::DecodeCache>();
    cx.model->prefill_media(head, a.par, *state);
    a.media_state = std::move(state);
    a.frames.frames = at::Tensor();  // encoded: the pixels are done with
  } catch (const std::exception& e) {
    a.error = e.what();
  }
  a.media_s = since(t0);
}

// This rank's workers take turns (State::worker_busy): held for a worker's life, given back
// however it ends.
class WorkerTurn {
 public:
  explicit WorkerTurn(QaSession::State& cx) : cx_(cx) {
    std::unique_lock<std::mutex> lock(cx_.worker_mu);
    cx_.worker_cv.wait(lock, [&] { return !cx_.worker_busy; });
    cx_.worker_busy = true;
  }
  ~WorkerTurn() {
    {
      std::lock_guard<std::mutex> lock(cx_.worker_mu);
      cx_.worker_busy = false;
    }
    cx_.worker_cv.notify_one();
  }
  WorkerTurn(const WorkerTurn&) = delete;
  WorkerTurn& operator=(const WorkerTurn&) = delete;

 private:
  QaSession::State& cx_;
};

// What begin leaves to this rank alone after the look-up: the frames, the prompt and, for a
// prompt prefilled in chunks, its media.
void prepare(QaSession::State& cx, QaAnswer& a) {
  if (!a.error.empty()) return;
  decode_frames(cx, a);
  if (!a.error.empty()) return;
  take_prompt(cx, a);
  if (!a.failed) prepare_media(cx, a);
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
// the prefix this prompt made (another system message, plan or frame count replaces it); then
// every rank's cache bytes summed (collective: every rank ends the same prefill at the same
// command), so that a server's gauge follows what was kept at once.
void keep_visual(QaSession::State& cx, QaAnswer& a) {
  if (!cx.cache->enabled()) return;
  if (!a.cached && a.encoded.features.defined()) {
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
  at::Tensor bytes = at::tensor({cx.cache->stats().bytes}, at::kLong);
  cx.pg->all_reduce(bytes);
  cx.cache_bytes_all = bytes.item<int64_t>();
}

// The generation of an answer whose media and prompt are ready (advance, every rank).
void start_generation(QaSession::State& cx, QaAnswer& a) {
  const std::function<void(const std::string&)> sink =
      a.hooks.on_text ? a.hooks.on_text : [](const std::string&) {};
  a.text = std::make_unique<TextStream>(*cx.tok, cx.stop, sink);
  GenerateOptions g = generation_options(cx, a);
  g.prefilled_media = std::move(a.media_state);
  // Frames go to the device once, after preprocessing; the prompt's ids stay host metadata.
  models::ModelInputs in{a.ids, at::Tensor(), /*pixels_local=*/true, {}};
  if (a.cached) {
    a.encoded = a.cached->media;
    in.media = &a.encoded;
  } else {
    in.pixel_values = a.frames.frames.defined() ? a.frames.frames.to(cx.device) : at::Tensor();
    if (cx.cache->enabled() && !a.req.text_only) in.media = &a.encoded;
  }
  a.gen = std::make_unique<Generation>(*cx.model, in, a.par, g);
  a.frames.frames = at::Tensor();  // encoded by now (or by the worker): the pixels are done with
  if (!a.gen->prefilling()) keep_visual(cx, a);
}

// The answer's tokens before the stop token: their text (ids without one dropped), their
// number, and whether a stop token ended them.
struct Completion {
  std::string response;
  int64_t completion_tokens = 0;
  bool stop_token = false;
};
// The generated tokens read up to the stop token, and their text decoded.
Completion completion_of(const QaSession::State& cx, const GenerateResult& out) {
  Completion c;
  std::vector<int64_t> answer_ids;
  for (int64_t i = 0; i < out.tokens.size(1); ++i) {
    const int64_t id = out.tokens[0][i].item<int64_t>();
    if (std::find(cx.stop.begin(), cx.stop.end(), id) != cx.stop.end()) {
      c.stop_token = true;
      break;
    }
    ++c.completion_tokens;
    if (known_id(*cx.tok, id)) answer_ids.push_back(id);
  }
  c.response = cx.tok->decode(answer_ids, /*skip_special_tokens=*/true);
  return c;
}

// What the ranks agree on for the row: timings, bytes, frame indices and pts.
struct Gathered {
  at::Tensor times, bytes, indices, pts;
};
// The ranks' timings and bytes reduced, their frames gathered in order (collective).
Gathered gather_measures(QaSession::State& cx, const QaAnswer& a, const GenerateResult& out) {
  dist::ProcessGroup& pg = *cx.pg;
  const int n = pg.world_size();
  // The slowest rank's timings; every rank's bytes; every rank's frames in sampled order.
  double per_token = 0;
  for (double t : out.token_seconds) per_token += t;
  if (!out.token_seconds.empty()) per_token /= static_cast<double>(out.token_seconds.size());
  at::Tensor times = at::tensor(
      {a.video_s, out.encode_seconds, out.prefill_seconds + a.media_s, per_token, since(a.t_start)},
      at::kDouble);
  pg.all_reduce(times, dist::ReduceOp::kMax);
  const VisualCacheStats cs = cx.cache->stats();
  at::Tensor bytes =
      at::tensor({out.prefill_bytes_sent, out.decode_bytes_sent, int64_t{a.cached ? 1 : 0},
                  int64_t{!a.cached && cx.cache->enabled() && !a.req.text_only}, cs.bytes},
                 at::kLong);
  pg.all_reduce(bytes);
  cx.cache_bytes_all = bytes[4].item<int64_t>();
  const attention::Layout frames_layout{attention::LayoutKind::kStriped, a.m, n};
  auto in_order = [&](const at::Tensor& local) {
    if (a.m == 0) return local;  // text only: no frame anywhere
    const at::Tensor all = pg.all_gather(local, frames_layout.sizes());
    return all.index_select(0, at::argsort(frames_layout.gathered_positions()));
  };
  const at::Tensor indices = in_order(a.cached ? a.cached->indices : a.frames.indices);
  const at::Tensor pts = in_order(a.cached ? a.cached->pts : a.frames.pts);
  return {times, bytes, indices, pts};
}

// The row's answer: the response, parsed and checked, its frames, prompt and tokens.
void put_answer(QaSession::State& cx, QaAnswer& a, const GenerateResult& out, const Completion& c,
                const Gathered& g) {
  const int r = cx.pg->rank();
  json& row = a.row;
  const QaItem& item = a.req.item;
  row["response"] = c.response;
  row["parsed_answer"] = parse_answer(item, c.response);
  if (!item.answer.empty()) row["correct"] = row["parsed_answer"] == expected_answer(item);
  row["frames"] = a.m;
  row["frame_indices"] = std::vector<int64_t>(g.indices.data_ptr<int64_t>(),
                                              g.indices.data_ptr<int64_t>() + g.indices.numel());
  row["pts_seconds"] =
      std::vector<double>(g.pts.data_ptr<double>(), g.pts.data_ptr<double>() + g.pts.numel());
  row["prompt_tokens"] = static_cast<int64_t>(a.prompt.ids.size());
  if (a.req.return_prompt_ids) row["prompt_ids"] = a.prompt.ids;
  if (!a.media_hash.empty()) row["media_hash"] = a.media_hash;
  if (a.gen->options().logprobs >= 0) {  // the completion tokens' (before the stop token)
    row["logprobs"] = json::array();
    for (int64_t i = 0; i < c.completion_tokens; ++i)
      row["logprobs"].push_back(logprob_json(*cx.tok, out.logprobs[static_cast<size_t>(i)]));
  }
  row["new_tokens"] = out.tokens.size(1);
  row["completion_tokens"] = c.completion_tokens;
  row["finish_reason"] = c.stop_token || out.stopped ? "stop" : "length";
  if (out.hit_context) {
    row["stopped_at_context"] = cx.context;
    if (r == 0)
      std::cerr << "[qa] " << item.id << ": generation stopped after " << out.tokens.size(1)
                << " tokens: the model's context of " << cx.context << " tokens is full\n";
  }
}

// The row's measures: video events, ranks, plan, timings, bytes and the visual cache's counts.
void put_measures(QaSession::State& cx, QaAnswer& a, const GenerateResult& out, const Gathered& g) {
  const at::Tensor& times = g.times;
  const at::Tensor& bytes = g.bytes;
  json& row = a.row;
  if (!a.events.empty()) row["video_events"] = a.events;
  row["ranks"] = cx.pg->world_size();
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
}

}  // namespace

QaAnswerPtr QaSession::begin(const QaRequest& req, const AnswerHooks& hooks) {
  c10::InferenceMode inference;
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
  look_up(cx, *a);
  if (a->cached || !a->error.empty()) {  // nothing to decode or encode: at once
    prepare(cx, *a);
    return a;
  }
  QaAnswer* ap = a.get();
  const at::Device device = cx.device;
  a->work = std::async(std::launch::async, [&cx, ap, device] {
    c10::InferenceMode inference;
    c10::OptionalDeviceGuard guard;
    if (device.is_cuda()) guard.reset_device(device);
    WorkerTurn turn(cx);
    prepare(cx, *ap);
  });
  return a;
}

bool QaSession::prepared(const QaAnswer& a) const {
  return !a.work.valid() || a.work.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

void QaSession::advance(QaAnswer& a) {
  c10::InferenceMode inference;
  State& cx = *s_;
  LVX_CHECK(!a.advanced, "QaSession::advance: the answer was advanced already");
  if (a.work.valid()) a.work.get();  // an exception of the worker is this rank's failure
  a.advanced = true;
  const std::string error = agree_on_error(*cx.pg, a.error);
  if (!error.empty()) {
    a.row["error"] = error;
    a.failed = true;
    return;
  }
  if (a.failed) return;  // the prompt's error: the same on every rank
  start_generation(cx, a);
}

bool QaSession::advanced(const QaAnswer& a) const { return a.advanced; }
const std::string& QaSession::answer_id(const QaAnswer& a) const { return a.req.item.id; }

bool QaSession::prefilling(const QaAnswer& a) const {
  return a.advanced && !a.failed && a.gen->prefilling();
}

void QaSession::prefill_next(QaAnswer& a) {
  c10::InferenceMode inference;
  State& cx = *s_;
  a.gen->prefill_next(*cx.model, a.par);
  if (!a.gen->prefilling()) keep_visual(cx, a);
}

bool QaSession::done(const QaAnswer& a) const { return a.advanced && (a.failed || a.gen->done()); }

bool QaSession::awaits_first_token(const QaAnswer& a) const {
  return a.advanced && !a.failed && !a.gen->prefilling() && !a.gen->done() &&
         a.gen->tokens_taken() == 0;
}

QaAnswerPtr QaSession::start(const QaRequest& req, const AnswerHooks& hooks) {
  QaAnswerPtr a = begin(req, hooks);
  advance(*a);
  return a;
}

void QaSession::step(const std::vector<QaAnswer*>& answers) {
  c10::InferenceMode inference;
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
  c10::InferenceMode inference;
  if (a.failed) return a.row;
  State& cx = *s_;
  const GenerateResult out = a.gen->finish();
  const Completion c = completion_of(cx, out);
  const Gathered g = gather_measures(cx, a, out);
  put_answer(cx, a, out, c, g);
  put_measures(cx, a, out, g);
  return a.row;
}

json QaSession::answer(const QaRequest& req, const AnswerHooks& hooks) {
  const QaAnswerPtr a = start(req, hooks);
  a->par.lead_decode = s_->job.lead_decode;  // stepped alone: rank 0 may decode by itself
  while (prefilling(*a)) prefill_next(*a);
  while (!done(*a)) step({a.get()});
  return finish(*a);
}

}  // namespace lvx::runtime
