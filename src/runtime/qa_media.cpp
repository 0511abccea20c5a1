// Frames of a list of images and the visual cache's keys; see qa_media.h.
#include "src/runtime/qa_media.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "src/common/error.h"
#include "src/common/files.h"

namespace lvx::runtime {

using nlohmann::json;

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
namespace {

struct Known {
  struct stat st;
  std::string hash;
};

// 192 bytes of splitmix64 from `seed` (a secret of uniform bytes cancels out of XXH3's short
// inputs, whose mixing XORs two secret words).
std::string mixed_bytes(uint64_t seed) {
  std::string s(192, '\0');
  for (char& ch : s) {
    uint64_t z = (seed += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    ch = static_cast<char>(z ^ (z >> 31));
  }
  return s;
}

// The content secret and the hashes made under it, under one lock.
struct ContentKeys {
  std::mutex mu;
  std::string secret = mixed_bytes(0x6c7678);  // until a session sets its own
  std::map<std::string, Known> known;
};

ContentKeys& content_keys() {
  static ContentKeys keys;
  return keys;
}

}  // namespace

void set_content_secret(const std::string& secret) {
  LVX_CHECK(secret.size() >= 136, "content secret: ", secret.size(), " bytes, fewer than 136");
  ContentKeys& c = content_keys();
  std::lock_guard<std::mutex> lock(c.mu);
  c.secret = secret;
  c.known.clear();
}

std::string content_secret() {
  ContentKeys& c = content_keys();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.secret;
}

std::string content_hash(const std::string& path) {
  ContentKeys& keys = content_keys();
  std::mutex& mu = keys.mu;
  std::map<std::string, Known>& known = keys.known;
  struct stat st {};
  LVX_CHECK(::stat(path.c_str(), &st) == 0, path, ": cannot stat: ", std::strerror(errno));
  auto same = [](const struct stat& a, const struct stat& b) {
    return a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_size == b.st_size &&
           a.st_mtim.tv_sec == b.st_mtim.tv_sec && a.st_mtim.tv_nsec == b.st_mtim.tv_nsec &&
           a.st_ctim.tv_sec == b.st_ctim.tv_sec && a.st_ctim.tv_nsec == b.st_ctim.tv_nsec;
  };
  std::string secret;
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = known.find(path);
    if (it != known.end() && same(it->second.st, st)) return it->second.hash;
    secret = keys.secret;
  }
  const std::string hash = file_keyed_xxh3(path, secret);
  struct stat after {};
  if (::stat(path.c_str(), &after) == 0 && same(st, after)) {  // unchanged while hashed
    std::lock_guard<std::mutex> lock(mu);
    if (keys.secret != secret) return hash;  // a new secret meanwhile: not kept
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

std::string video_hash(const QaRequest& req) {
  return req.item.video.empty() ? req.media_hash : content_hash(req.item.video);
}

std::string visual_key(const QaRequest& req, const video::SampleSpec& spec,
                       const video::PreprocessConfig& pre, const std::string& dtype, int rank,
                       int world) {
  std::string source;
  if (!req.image_files.empty()) {
    source = "frames:";
    for (const std::string& f : req.image_files) source += content_hash(f);
  } else {
    source = "video:" + video_hash(req);
  }
  auto opt = [](const auto& v) { return v ? json(*v) : json(); };
  const json k{{"tenant", req.tenant},
               {"source", source},
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

}  // namespace lvx::runtime
