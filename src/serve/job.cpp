// A request and its answer; see job.h.
#include "src/serve/job.h"

#include <algorithm>

namespace lvx::serve {

void Job::push_text(const std::string& piece) {
  if (stop_hit) return;
  text += piece;
  size_t safe = text.size();
  size_t longest = 0;
  for (const std::string& s : req.stop) {
    const size_t at = text.find(s, sent > s.size() ? sent - s.size() : 0);
    if (at != std::string::npos && at < safe) {
      safe = at;
      stop_hit = true;
    }
    longest = std::max(longest, s.size());
  }
  if (stop_hit) {
    text.resize(safe);
  } else if (longest > 1) {  // a stop string may begin in the last bytes: hold them back
    safe = text.size() >= longest - 1 ? text.size() - (longest - 1) : 0;
  }
  if (safe > sent) {
    std::lock_guard<std::mutex> lock(mu);
    pieces.push_back(text.substr(sent, safe - sent));
    sent = safe;
    first = settled = true;
    cv.notify_all();
  }
}

void Job::finish(json r, const std::string& finish, const std::string& final_text) {
  std::lock_guard<std::mutex> lock(mu);
  if (final_text.size() > sent && final_text.compare(0, sent, text, 0, sent) == 0)
    pieces.push_back(final_text.substr(sent));
  sent = final_text.size();
  content = final_text;
  row = std::move(r);
  finish_reason = finish;
  done = first = settled = true;
  cv.notify_all();
}

void Job::push_logprob(const json& entry) {
  if (stop_hit) return;
  std::lock_guard<std::mutex> lock(mu);
  logprob_entries.push_back(entry);
  cv.notify_all();
}

void Job::fail(const ApiError& e) {
  std::lock_guard<std::mutex> lock(mu);
  error = e;
  done = first = settled = true;
  cv.notify_all();
}

std::string generation_key(const json& desc) {
  json d = desc;
  d.erase("id");
  return d.dump();
}

}  // namespace lvx::serve

namespace lvx::serve {

bool same_media(const ChatRequest& a, const ChatRequest& b) {
  auto same = [](const MediaRef& x, const MediaRef& y) {
    if (x.upload || y.upload)  // each request's own file: the same content
      return x.upload && y.upload && x.hash == y.hash && x.ext == y.ext;
    return x.path == y.path && x.ext == y.ext;  // files named (data URLs are uploads)
  };
  if (a.video.has_value() != b.video.has_value() || a.video_hash != b.video_hash ||
      a.frames.size() != b.frames.size())
    return false;
  if (a.video && !same(*a.video, *b.video)) return false;
  for (size_t i = 0; i < a.frames.size(); ++i)
    if (!same(a.frames[i], b.frames[i])) return false;
  return true;
}

}  // namespace lvx::serve
