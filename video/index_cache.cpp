// Frame index cache files (see index_cache.h). Plain POSIX calls: libtorch.so exports its own,
// broken, std::filesystem symbols in this build.
#include "video/index_cache.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

namespace lvx::video {
namespace {

// Bumped whenever the layout or the meaning of a field changes: old entries are then rebuilt.
constexpr char kMagic[8] = {'L', 'V', 'X', 'I', 'D', 'X', '0', '1'};

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// What identifies one version of one file's stream: a changed file gives a different key.
struct Key {
  std::string real_path;
  int64_t size = 0, mtime_ns = 0, dev = 0, ino = 0;
  int32_t stream = 0;
};

bool make_key(const std::string& path, int stream, Key* key) {
  char* real = ::realpath(path.c_str(), nullptr);
  if (!real) return false;
  key->real_path = real;
  std::free(real);
  struct stat st {};
  if (::stat(key->real_path.c_str(), &st) != 0) return false;
  key->size = st.st_size;
  key->mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  key->dev = static_cast<int64_t>(st.st_dev);
  key->ino = static_cast<int64_t>(st.st_ino);
  key->stream = stream;
  return true;
}

bool mkdirs(const std::string& dir) {
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at < dir.size() && dir[at] != '/') continue;
    const std::string part = dir.substr(0, at);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) return false;
  }
  struct stat st {};
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    buf_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void put(const std::string& s) {
    put<int64_t>(static_cast<int64_t>(s.size()));
    buf_ += s;
  }
  template <typename T>
  void put(const std::vector<T>& v) {
    buf_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  const std::string& bytes() const { return buf_; }

 private:
  std::string buf_;
};

class Reader {
 public:
  explicit Reader(const std::string& b) : b_(b) {}
  template <typename T>
  bool get(T* v) {
    if (at_ + sizeof(T) > b_.size()) return false;
    std::memcpy(v, b_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  bool get(std::string* s) {
    int64_t n = 0;
    if (!get(&n) || n < 0 || at_ + static_cast<size_t>(n) > b_.size()) return false;
    s->assign(b_.data() + at_, static_cast<size_t>(n));
    at_ += static_cast<size_t>(n);
    return true;
  }
  template <typename T>
  bool get(std::vector<T>* v, int64_t n) {
    const size_t bytes = static_cast<size_t>(n) * sizeof(T);
    if (at_ + bytes > b_.size()) return false;
    v->resize(static_cast<size_t>(n));
    std::memcpy(v->data(), b_.data() + at_, bytes);
    at_ += bytes;
    return true;
  }
  bool done() const { return at_ == b_.size(); }

 private:
  const std::string& b_;
  size_t at_ = 0;
};

std::string serialize(const Key& key, const FrameIndex& index) {
  Writer w;
  w.put(key.real_path);
  w.put(key.size);
  w.put(key.mtime_ns);
  w.put(key.dev);
  w.put(key.ino);
  w.put(key.stream);
  w.put<int32_t>(index.time_base.num);
  w.put<int32_t>(index.time_base.den);
  w.put(index.num_frames());
  w.put(index.end_pts);
  w.put<uint8_t>(index.end_from_container);
  w.put<uint8_t>(index.truncated);
  w.put(index.truncation_reason);
  w.put(index.pts);
  w.put(index.dts);
  w.put(index.pos);
  w.put(index.keyframe);
  std::string out(kMagic, sizeof(kMagic));
  const uint64_t sum = fnv1a(w.bytes().data(), w.bytes().size());
  out.append(reinterpret_cast<const char*>(&sum), sizeof(sum));
  return out + w.bytes();
}

// True when `file` holds a well-formed entry for exactly `key`.
bool deserialize(const std::string& file, const Key& key, FrameIndex* index) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return false;
  const std::string all((std::istreambuf_iterator<char>(in)), {});
  if (all.size() < sizeof(kMagic) + 8 || std::memcmp(all.data(), kMagic, sizeof(kMagic)) != 0)
    return false;
  uint64_t sum = 0;
  std::memcpy(&sum, all.data() + sizeof(kMagic), sizeof(sum));
  const std::string payload = all.substr(sizeof(kMagic) + sizeof(sum));
  if (fnv1a(payload.data(), payload.size()) != sum) return false;
  Reader r(payload);
  Key k;
  int32_t num = 0, den = 0;
  int64_t n = 0;
  uint8_t from_container = 0, truncated = 0;
  if (!r.get(&k.real_path) || !r.get(&k.size) || !r.get(&k.mtime_ns) || !r.get(&k.dev) ||
      !r.get(&k.ino) || !r.get(&k.stream) || !r.get(&num) || !r.get(&den) || !r.get(&n) ||
      !r.get(&index->end_pts) || !r.get(&from_container) || !r.get(&truncated) ||
      !r.get(&index->truncation_reason))
    return false;
  if (k.real_path != key.real_path || k.size != key.size || k.mtime_ns != key.mtime_ns ||
      k.dev != key.dev || k.ino != key.ino || k.stream != key.stream)
    return false;  // another file (hash collision) or an older version of this one
  if (n <= 0 || num <= 0 || den <= 0) return false;
  if (!r.get(&index->pts, n) || !r.get(&index->dts, n) || !r.get(&index->pos, n) ||
      !r.get(&index->keyframe, n) || !r.done())
    return false;
  index->time_base = AVRational{num, den};
  index->end_from_container = from_container != 0;
  index->truncated = truncated != 0;
  return true;
}

// Writes `bytes` to `file` atomically: readers see the old entry or the new one, never half.
void write_atomically(const std::string& file, const std::string& bytes) {
  const std::string tmp = lvx::str(file, ".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      return;  // a full or read-only disk: the next run scans again
    }
  }
  if (std::rename(tmp.c_str(), file.c_str()) != 0) std::remove(tmp.c_str());
}

// An exclusive advisory lock on `file`, held for the object's lifetime (released on close).
class FileLock {
 public:
  explicit FileLock(const std::string& file) : fd_(::open(file.c_str(), O_RDWR | O_CREAT, 0644)) {
    if (fd_ >= 0 && ::flock(fd_, LOCK_EX) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};

}  // namespace

std::string index_cache_dir() {
  if (const char* v = std::getenv("LVX_INDEX_CACHE"); v && *v) {
    const std::string s = v;
    if (s == "off" || s == "0" || s == "none") return "";
    return s;
  }
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/lvx/index";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/lvx/index";
  return "";
}

std::string index_cache_file(const std::string& path, int stream_index) {
  const std::string dir = index_cache_dir();
  Key key;
  if (dir.empty() || !make_key(path, stream_index, &key)) return "";
  const std::string id = lvx::str(key.real_path, "#", stream_index);
  char name[32];
  std::snprintf(name, sizeof(name), "%016llx.idx",
                static_cast<unsigned long long>(fnv1a(id.data(), id.size())));
  return dir + "/" + name;
}

FrameIndex load_or_scan_frame_index(AVFormatContext* fmt, int stream_index, const std::string& path,
                                    bool use_cache, bool* from_cache) {
  *from_cache = false;
  Key key;
  const std::string file = use_cache ? index_cache_file(path, stream_index) : "";
  if (file.empty() || !mkdirs(index_cache_dir()) || !make_key(path, stream_index, &key))
    return scan_frame_index(fmt, stream_index, path);
  // One scanner per entry: the ranks that start together wait here for the first one's result.
  FileLock lock(file + ".lock");
  FrameIndex index;
  if (deserialize(file, key, &index)) {
    *from_cache = true;
    return index;
  }
  index = scan_frame_index(fmt, stream_index, path);
  // A file rewritten while it was scanned gets no entry: the scan may mix both versions.
  Key after;
  if (make_key(path, stream_index, &after) && after.size == key.size &&
      after.mtime_ns == key.mtime_ns && after.ino == key.ino)
    write_atomically(file, serialize(key, index));
  return index;
}

}  // namespace lvx::video
