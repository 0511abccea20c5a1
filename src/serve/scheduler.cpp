// Continuous batching on rank 0 and the other ranks' loop that follows it. Rank 0's main thread
// takes queued requests while fewer than --max-batch generations run, broadcasts each one's
// description (wire.h) and every rank begins it (QaSession::begin: a cache hit at once; a miss's
// frames decoded, and its media encoded for a chunked prefill, on a worker thread of each rank);
// an answer whose frames are ready on rank 0 is started on every rank (kAdvance); one chunk of
// the oldest prompt prefilled in chunks runs (kChunk, at most --max-batch-tokens tokens); then a
// step gives every running generation its next token (QaSession::step); generations that are
// done leave in batch order (QaSession::finish) and their clients get their answers. So a long
// prompt holds the others for one chunk at a time, never for its whole prefill. The other ranks
// do what each broadcast says, in its order.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "src/common/error.h"
#include "src/common/files.h"
#include "src/serve/server_impl.h"
#include "src/serve/upload.h"

namespace lvx::serve {

json Server::describe(const Job& job, std::vector<std::string>* blobs) const {
  const ChatRequest& r = job.req;
  size_t blob = 0;
  auto ref = [&](const MediaRef& m) {
    if (m.upload && !blobs) return json{{"upload", m.hash}, {"ext", m.ext}};  // the key: content
    if (m.upload && ranks_share_host_) return json{{"path", m.path}, {"upload", true}};
    if (!m.path.empty() && !m.upload) return json{{"path", m.path}};
    // Ranks on other machines get the bytes (an upload read back from its file).
    if (blobs) blobs->push_back(read_file(m.path, "the upload", INT64_MAX));
    return json{{"blob", blob++}, {"ext", m.ext}};
  };
  auto opt = [](const auto& v) { return v ? json(*v) : json(); };
  json d{{"id", job.id},
         {"tenant", o_.shared_visual_cache ? std::string() : job.scope},
         {"system", r.system},
         {"earlier", r.earlier},
         {"question", r.question},
         {"return_prompt_ids", r.return_prompt_ids},
         {"fps", opt(r.fps)},
         {"num_frames", opt(r.num_frames)},
         {"start", opt(r.start)},
         {"end", opt(r.end)},
         {"video_id", r.video_id},
         {"max_tokens", r.max_tokens},
         {"temperature", r.temperature},
         {"top_p", r.top_p},
         {"seed", r.seed},
         {"logprobs", r.logprobs ? r.top_logprobs : -1},
         {"text_only", r.text_only()}};
  if (r.completion) d["prompt"] = r.prompt;
  if (r.completion && !r.text_only()) d["prompt_after_media"] = r.prompt_after_media;
  if (r.video) d["video"] = ref(*r.video);
  if (!r.video && !r.video_hash.empty()) d["video"] = json{{"hash", r.video_hash}};  // by uuid
  if (r.video && !r.video_uuid.empty()) d["return_media_hash"] = true;  // to remember its uuid
  json frames = json::array();
  for (const MediaRef& m : r.frames) frames.push_back(ref(m));
  d["frames"] = frames;
  return d;
}

Server::Begun Server::begin_answer(const Command& c, const runtime::AnswerHooks& hooks) {
  const json& d = c.desc;
  // Media sent as bytes (ranks on another machine than rank 0) go into a private folder of this
  // rank's (upload.h), made only when there are any and removed once the answer has advanced
  // (its frames are read by then).
  Begun begun;
  begun.uploads = std::make_unique<UploadDir>();
  auto file_of = [&](const json& ref, const std::string& name) -> std::string {
    if (ref.contains("path")) return ref["path"].get<std::string>();
    return begun.uploads->write(c.blobs.at(ref["blob"].get<size_t>()),
                                name + ref["ext"].get<std::string>());
  };
  runtime::QaRequest q;
  q.item.id = d["id"].get<std::string>();
  q.item.question = d["question"].get<std::string>();
  q.item.system = d["system"].get<std::string>();
  q.earlier = d["earlier"].get<std::vector<std::pair<std::string, std::string>>>();
  q.return_prompt_ids = d["return_prompt_ids"].get<bool>();
  q.tenant = d["tenant"].get<std::string>();
  q.text_only = d.value("text_only", false);
  if (d.contains("prompt")) q.raw_prompt = d["prompt"].get<std::string>();
  if (d.contains("prompt_after_media"))
    q.raw_after_media = d["prompt_after_media"].get<std::string>();
  if (d.contains("video") && d["video"].contains("hash"))
    q.media_hash = d["video"]["hash"].get<std::string>();  // named by its uuid: the cache's alone
  else if (d.contains("video"))
    q.item.video = file_of(d["video"], "video");
  q.return_media_hash = d.value("return_media_hash", false);
  q.cache_frame_index =  // an upload's index would never be read again
      !(d.contains("video") && (d["video"].contains("blob") || d["video"].contains("upload")));
  for (size_t i = 0; i < d["frames"].size(); ++i)
    q.image_files.push_back(file_of(d["frames"][i], "frame" + std::to_string(i)));
  if (!d["fps"].is_null()) q.fps = d["fps"].get<double>();
  if (!d["num_frames"].is_null()) q.num_frames = d["num_frames"].get<int64_t>();
  if (!d["start"].is_null()) q.item.start = d["start"].get<double>();
  if (!d["end"].is_null()) q.item.end = d["end"].get<double>();
  q.video_id = d["video_id"].get<std::string>();
  runtime::GenerateOptions g = session_.job().generation;
  g.max_new_tokens = d["max_tokens"].get<int64_t>();
  g.sampling.temperature = d["temperature"].get<double>();
  g.sampling.top_p = d["top_p"].get<double>();
  g.sampling.seed = d["seed"].get<uint64_t>();
  g.logprobs = d["logprobs"].get<int64_t>();
  q.generation = g;
  begun.answer = session_.begin(q, hooks);
  return begun;
}

int Server::run_other_rank() {
  ::signal(SIGTERM, SIG_IGN);  // rank 0 says when to stop
  ::signal(SIGINT, SIG_IGN);
  // The generations rank 0 runs, in its order: begun, advanced, prefilled, stepped and finished
  // as it says.
  std::vector<Begun> active;
  runtime::AnswerHooks hooks;
  hooks.stop_requested = [] { return false; };  // set on every rank (rank 0's flag is the one)
  auto named = [&](const Command& c) -> Begun& {
    const std::string id = c.desc.at("id").get<std::string>();
    for (Begun& b : active)
      if (session_.answer_id(*b.answer) == id) return b;
    LVX_FAIL("serve: rank 0 named answer '", id, "', which this rank does not run");
  };
  for (;;) {
    Command c;
    exchange(pg_, c);
    if (c.op == Op::kShutdown) {
      pg_.barrier();
      return 0;
    }
    if (c.op == Op::kAnswer) active.push_back(begin_answer(c, hooks));
    if (c.op == Op::kAdvance) {
      Begun& b = named(c);
      session_.advance(*b.answer);
      b.uploads.reset();
    }
    if (c.op == Op::kChunk) session_.prefill_next(*named(c).answer);
    if (c.op == Op::kStep) {
      std::vector<runtime::QaAnswer*> step;
      for (Begun& b : active)
        if (steps(*b.answer)) step.push_back(b.answer.get());
      session_.step(step);
    }
    for (auto it = active.begin(); it != active.end();) {
      if (!session_.done(*it->answer)) {
        ++it;
        continue;
      }
      session_.finish(*it->answer);
      it = active.erase(it);
    }
  }
}

bool Server::front_ready() const {
  if (queue_.empty()) return false;
  // A later choice of a request with n > 1 waits for the first's prefill: it then reuses the
  // prompt's prefix (visual features and their K/V) instead of prefilling it again.
  const std::shared_ptr<Job>& after = queue_.front()->after;
  return !after || after->settled || after->cancelled;
}

bool Server::awaits_first_token() const {
  return std::any_of(batch_.begin(), batch_.end(),
                     [&](const auto& r) { return session_.awaits_first_token(*r->answer); });
}

bool Server::steps(const runtime::QaAnswer& a) const {
  return session_.advanced(a) && !session_.prefilling(a) && !session_.done(a);
}

std::shared_ptr<Job> Server::take_job() {
  std::unique_lock<std::mutex> lock(qmu_);
  if (static_cast<int64_t>(batch_.size()) >= o_.max_batch) return nullptr;
  if (batch_.empty())
    qcv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return !queue_.empty(); });
  if (!front_ready()) return nullptr;
  // --max-kv-bytes: the next request waits (in order) until the generations running leave room
  // for its KV (src/serve/kv_budget.h); alone it always fits (a larger one was refused).
  if (o_.max_kv_bytes > 0 && !batch_.empty() &&
      kv_in_use_ + queue_.front()->kv_cost > o_.max_kv_bytes)
    return nullptr;
  std::shared_ptr<Job> job = queue_.front();
  queue_.pop_front();
  return job;
}

void Server::admit(const std::shared_ptr<Job>& job) {
  auto r = std::make_unique<Running>();
  r->command.op = Op::kAnswer;
  r->command.desc = describe(*job, &r->command.blobs);
  r->key = job->key;
  r->group = {job};
  r->kv_cost = job->kv_cost;  // the generation's, whoever joins it
  {
    std::lock_guard<std::mutex> lock(qmu_);
    kv_in_use_ += r->kv_cost;
  }
  // Queued requests identical to this one in everything their tokens depend on (media,
  // sampling and seed, conversation, max_tokens) share its generation: the same inputs give
  // the same tokens, so each gets exactly the answer it would get alone. What only their own
  // responses use (stop strings, streaming, usage) stays theirs.
  if (o_.merge_identical) {
    std::lock_guard<std::mutex> lock(qmu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (!(*it)->cancelled && (*it)->key == r->key && same_media((*it)->req, job->req)) {
        r->group.push_back(*it);
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const auto& j : r->group) metrics_.observe(&Metrics::queue, seconds_since(j->received));
  Running* rp = r.get();
  runtime::AnswerHooks hooks;
  hooks.on_text = [this, rp](const std::string& piece) {
    std::lock_guard<std::mutex> lock(gmu_);
    rp->pieces.push_back(piece);
    for (const auto& j : rp->group) {
      note_text(*j);
      j->push_text(piece);
    }
  };
  if (job->req.logprobs)
    hooks.on_logprob = [this, rp](const json& entry) {
      std::lock_guard<std::mutex> lock(gmu_);
      rp->logprob_entries.push_back(entry);
      for (const auto& j : rp->group) j->push_logprob(entry);
    };
  hooks.stop_requested = [this, rp] {  // every client of the generation left or has its stop
    std::lock_guard<std::mutex> lock(gmu_);
    const bool all = std::all_of(rp->group.begin(), rp->group.end(),
                                 [](const auto& j) { return j->cancelled.load() || j->stop_hit; });
    if (all) rp->open = false;
    return all;
  };
  {
    std::lock_guard<std::mutex> lock(gmu_);
    r->open = o_.merge_identical;
    running_ += static_cast<int64_t>(r->group.size());
    batch_.push_back(std::move(r));
  }
  exchange(pg_, rp->command);
  Begun begun = begin_answer(rp->command, hooks);
  rp->answer = std::move(begun.answer);
  rp->uploads = std::move(begun.uploads);
  // Every rank wrote the media to its files: the copy for the broadcast is done with (joiners
  // compare with the first request's own media, same_media).
  std::vector<std::string>().swap(rp->command.blobs);
  advance_prepared();  // a cache hit starts at once
}

bool Server::advance_prepared() {
  bool sent = false;
  for (bool again = true; again;) {  // the batch changes as failures retire: look again
    again = false;
    for (auto& r : batch_) {
      if (session_.advanced(*r->answer) || !session_.prepared(*r->answer)) continue;
      Command c;
      c.op = Op::kAdvance;
      c.desc = json{{"id", session_.answer_id(*r->answer)}};
      exchange(pg_, c);
      session_.advance(*r->answer);
      note_cache_bytes();
      r->uploads.reset();
      retire_done();  // a video or prompt that failed: done at once
      sent = again = true;
      break;
    }
  }
  return sent;
}

void Server::note_cache_bytes() {
  std::lock_guard<std::mutex> lock(metrics_.mu);
  metrics_.cache_bytes = session_.cache_bytes_all();
}

bool Server::prefill_chunk() {
  for (auto& r : batch_) {
    if (!session_.prefilling(*r->answer)) continue;
    Command c;
    c.op = Op::kChunk;
    c.desc = json{{"id", session_.answer_id(*r->answer)}};
    exchange(pg_, c);
    session_.prefill_next(*r->answer);
    note_cache_bytes();
    std::lock_guard<std::mutex> lock(metrics_.mu);
    ++metrics_.prefill_chunks;
    return true;
  }
  return false;
}

void Server::wait_for_work(clock::time_point& last_command, double heartbeat_s) {
  {
    std::unique_lock<std::mutex> lock(qmu_);
    // A request waiting wakes the loop only when the batch has room to take it: with a full
    // batch the queue is not empty for as long as its frames decode, and waking on it spun a core.
    const bool room = static_cast<int64_t>(batch_.size()) < o_.max_batch;
    qcv_.wait_for(lock, std::chrono::milliseconds(1), [&] { return room && front_ready(); });
  }
  if (seconds_since(last_command) >= heartbeat_s) {  // the other ranks' liveness
    Command hb;
    exchange(pg_, hb);
    last_command = clock::now();
  }
}

bool Server::step_batch() {
  std::vector<runtime::QaAnswer*> step;
  for (auto& r : batch_)
    if (steps(*r->answer)) step.push_back(r->answer.get());
  if (step.empty()) return false;
  const bool prefilling = std::any_of(
      batch_.begin(), batch_.end(), [&](const auto& r) { return session_.prefilling(*r->answer); });
  Command c;
  c.op = Op::kStep;
  exchange(pg_, c);
  {
    std::lock_guard<std::mutex> lock(metrics_.mu);
    ++metrics_.steps;
    metrics_.steps_while_prefilling += prefilling ? 1 : 0;
    metrics_.step_rows += static_cast<int64_t>(step.size());
    metrics_.most_rows = std::max(metrics_.most_rows, static_cast<int64_t>(step.size()));
  }
  session_.step(step);
  retire_done();
  return true;
}

void Server::retire_done() {
  for (size_t i = 0; i < batch_.size();) {
    Running& r = *batch_[i];
    if (!session_.done(*r.answer)) {
      ++i;
      continue;
    }
    const json row = session_.finish(*r.answer);
    std::unique_ptr<Running> done;
    {
      std::lock_guard<std::mutex> lock(gmu_);
      r.open = false;
      done = std::move(batch_[i]);
      batch_.erase(batch_.begin() + static_cast<std::ptrdiff_t>(i));
      running_ -= static_cast<int64_t>(done->group.size());
      std::lock_guard<std::mutex> qlock(qmu_);
      joined_ -= done->joined;
      kv_in_use_ -= done->kv_cost;
    }
    complete(*done, row);
  }
}

// The clients of a finished generation: the metrics, then each answer (or the row's error).
void Server::complete(Running& r, const json& row) {
  {
    std::lock_guard<std::mutex> lock(metrics_.mu);
    metrics_.merged += static_cast<int64_t>(r.group.size()) - 1;
    for (const auto& j : r.group) metrics_.cancelled += j->cancelled ? 1 : 0;
    if (!row.contains("error") && row.contains("visual_cache")) {
      metrics_.cache_hits += row["visual_cache"]["hits"].get<int64_t>();
      metrics_.cache_misses += row["visual_cache"]["misses"].get<int64_t>();
      metrics_.prefix_reuses += row["visual_cache"].value("prefix_reused", false) ? 1 : 0;
      metrics_.cache_bytes = row["visual_cache"]["bytes"].get<int64_t>();
    }
    if (!row.contains("error")) {  // once per generation, however many clients it answered
      metrics_.prompt_tokens += row["prompt_tokens"].get<int64_t>();
      metrics_.completion_tokens += row["completion_tokens"].get<int64_t>();
    }
  }
  for (const auto& jp : r.group) {
    Job& j = *jp;
    if (!row.contains("error") && !j.req.video_uuid.empty() && row.contains("media_hash"))
      uuids_.remember(j.scope, j.req.video_uuid, row["media_hash"].get<std::string>());
    if (row.contains("error")) {
      j.fail(bad_request(client_error_text(row["error"].get<std::string>())));
      continue;
    }
    if (!j.ttft_counted) note_text(j);  // the end is its first text (an empty answer)
    metrics_.observe(&Metrics::request, seconds_since(j.received));
    std::string finish = row["finish_reason"].get<std::string>();
    if (j.stop_hit) finish = "stop";
    // The text as lvx qa gives it, unless a stop string cut it.
    j.finish(row, finish, j.stop_hit ? j.text : row["response"].get<std::string>());
  }
}

void Server::fail_queued(const ApiError& e) {
  std::deque<std::shared_ptr<Job>> q;
  {
    std::lock_guard<std::mutex> lock(qmu_);
    q.swap(queue_);
  }
  for (auto& j : q) j->fail(e);
}

void Server::serve_loop() {
  const double timeout_s = std::chrono::duration<double>(dist::options_from_env().timeout).count();
  const double heartbeat_s = std::clamp(timeout_s / 4, 0.2, 5.0);
  auto last_command = clock::now();
  for (;;) {
    // Every request waiting, while the batch has room: their question tokens then run in one
    // pass at the next step.
    while ((admitting_ = take_job())) {
      if (admitting_->cancelled) {  // its client left while it waited
        std::lock_guard<std::mutex> lock(metrics_.mu);
        ++metrics_.cancelled;
        continue;
      }
      admit(admitting_);
      admitting_.reset();
      last_command = clock::now();
    }
    if (g_stop_signal && !draining_) {
      draining_ = true;
      std::cerr << "lvx serve: stopping: finishing the requests in flight" << std::endl;
    }
    // A request admitted and started now takes its first token before the next chunk: its
    // question runs in this step's forward, its first token comes at the next step, then the
    // chunk. It waits for one chunk at most.
    bool sent = advance_prepared();
    sent = step_batch() || sent;
    if (awaits_first_token()) sent = step_batch() || sent;
    sent = prefill_chunk() || sent;
    if (sent) {
      last_command = clock::now();
      continue;
    }
    if (!batch_.empty()) {  // only frames being decoded
      wait_for_work(last_command, heartbeat_s);
      continue;
    }
    bool idle = false;
    {
      std::lock_guard<std::mutex> lock(qmu_);
      idle = queue_.empty();
    }
    if (!idle) continue;
    if (draining_) break;
    if (seconds_since(last_command) >= heartbeat_s) {  // the other ranks' liveness
      Command hb;
      exchange(pg_, hb);
      last_command = clock::now();
    }
  }
  Command bye;
  bye.op = Op::kShutdown;
  exchange(pg_, bye);
  pg_.barrier();
}

void Server::fail_everything(const std::exception& e) {
  failure_ = e.what();  // before failed_: HTTP threads read it once they see failed_
  failed_ = true;
  std::cerr << "lvx serve: " << e.what() << "\nlvx serve: answering 503 and stopping" << std::endl;
  const ApiError unavailable(503, "server_error", "a rank failed: " + client_error_text(failure_));
  std::vector<std::shared_ptr<Job>> waiting;
  {
    std::lock_guard<std::mutex> lock(gmu_);
    for (auto& r : batch_) {
      r->open = false;
      waiting.insert(waiting.end(), r->group.begin(), r->group.end());
    }
  }
  if (admitting_) waiting.push_back(admitting_);
  for (const auto& j : waiting) j->fail(unavailable);
  fail_queued(unavailable);
}

}  // namespace lvx::serve
