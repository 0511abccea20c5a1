#include "src/common/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "src/common/error.h"

namespace lvx {

namespace fs = std::filesystem;

namespace {

std::string kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m) || S_ISBLK(m)) return "a device";
  return "not a regular file";
}

// Opens a regular file for reading; a FIFO cannot block the open (O_NONBLOCK) and is refused by
// the fstat that follows, so there is no window between the check and the open.
int open_regular(const std::string& path, const std::string& what, uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    LVX_CHECK(err != ENOENT, what, " '", path, "' does not exist");
    LVX_FAIL(what, " '", path, "': cannot open (", std::strerror(err), ")");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string kind = kind_of(st.st_mode);
    ::close(fd);
    LVX_FAIL(what, " '", path, "' is ", kind, ", not a regular file");
  }
  // Reads block as usual from here on.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  if (size) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

template <typename Fn>
void read_chunks(const std::string& path, const std::string& what, Fn&& fn) {
  Fd f{open_regular(path, what, nullptr)};
  std::vector<char> buf(size_t{1} << 22);
  for (;;) {
    const ssize_t n = ::read(f.fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    LVX_CHECK(n >= 0, what, " '", path, "': read failed (", std::strerror(errno), ")");
    if (n == 0) break;
    fn(buf.data(), static_cast<size_t>(n));
  }
}

std::string hex16(uint64_t h) {
  char out[17];
  std::snprintf(out, sizeof(out), "%016llx", static_cast<unsigned long long>(h));
  return out;
}

}  // namespace

uint64_t check_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    LVX_CHECK(err != ENOENT, what, " '", path, "' does not exist");
    LVX_FAIL(what, " '", path, "': cannot read (", std::strerror(err), ")");
  }
  LVX_CHECK(S_ISREG(st.st_mode), what, " '", path, "' is ", kind_of(st.st_mode),
            ", not a regular file");
  return static_cast<uint64_t>(st.st_size);
}

std::string read_file(const std::string& path, const std::string& what, uint64_t max_bytes) {
  uint64_t size = 0;
  Fd f{open_regular(path, what, &size)};
  LVX_CHECK(size <= max_bytes, what, " '", path, "' has ", size, " bytes, more than the ",
            max_bytes, " such a file may have");
  std::string out(size, '\0');
  size_t got = 0;
  while (got < size) {
    const ssize_t n = ::read(f.fd, out.data() + got, size - got);
    if (n < 0 && errno == EINTR) continue;
    LVX_CHECK(n >= 0, what, " '", path, "': read failed (", std::strerror(errno), ")");
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  out.resize(got);
  return out;
}

void check_output_path(const std::string& path, const std::string& what) {
  LVX_CHECK(!path.empty(), what, ": empty path");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    LVX_CHECK(S_ISREG(st.st_mode), what, " '", path, "' is ", kind_of(st.st_mode),
              ", not a regular file");
    return;
  }
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty() && ::stat(parent.c_str(), &st) == 0)
    LVX_CHECK(S_ISDIR(st.st_mode), what, " '", path, "': its folder '", parent.string(), "' is ",
              kind_of(st.st_mode));
}

nlohmann::json parse_json(const std::string& text, const std::string& where, int max_depth) {
  // The nesting is checked by a scan of the text before parsing, so a deep document is refused
  // (an array or object at depth max_depth + 1) instead of built. Not with nlohmann's parse
  // callback: that parser (3.11) rescans the enclosing array at the end of every object, which
  // makes an array of 200k objects take minutes. Brackets inside strings do not count; the scan
  // is exact for valid JSON, and invalid JSON fails to parse at its first error, before which
  // the text is valid.
  int depth = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '"') {
      for (++i; i < text.size() && text[i] != '"'; ++i)
        if (text[i] == '\\') ++i;
    } else if (c == '[' || c == '{') {
      LVX_CHECK(depth < max_depth + 1, where, ": JSON nested deeper than ", max_depth, " levels");
      ++depth;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    LVX_FAIL(where, ": not valid JSON (", e.what(), ")");
  }
}

nlohmann::json read_json_file(const std::string& path, const std::string& what,
                              uint64_t max_bytes) {
  return parse_json(read_file(path, what, max_bytes), what + " '" + path + "'");
}

void for_each_jsonl(const std::string& path, const std::string& what,
                    const std::function<void(int64_t line, const nlohmann::json& row)>& fn,
                    const JsonlOptions& opt) {
  Fd f{open_regular(path, what, nullptr)};
  std::unique_ptr<FILE, int (*)(FILE*)> fp(::fdopen(f.fd, "rb"), &std::fclose);
  LVX_CHECK(fp != nullptr, what, " '", path, "': cannot open");
  f.fd = -1;  // owned by fp now
  std::vector<char> buf(size_t{1} << 16);
  std::string line;
  int64_t number = 0;
  uint64_t offset = 0, line_start = 0;
  for (;;) {
    line.clear();
    line_start = offset;
    bool newline = false, any = false;
    uint64_t length = 0;  // the line's bytes, kept in `line` up to max_line_bytes
    while (std::fgets(buf.data(), static_cast<int>(buf.size()), fp.get())) {
      any = true;
      const size_t n = std::strlen(buf.data());  // a NUL inside a row ends its text: JSON has none
      length += n;
      if (length <= opt.max_line_bytes) {
        line.append(buf.data(), n);
      } else {
        const std::string e = str(what, " '", path, "' line ", number + 1, ": longer than ",
                                  opt.max_line_bytes, " bytes");
        LVX_CHECK(opt.on_bad_line != nullptr, e);
        line.clear();  // the rest of the line is skipped, not kept
      }
      if (n && buf[n - 1] == '\n') {
        newline = true;
        break;
      }
    }
    LVX_CHECK(!std::ferror(fp.get()), what, " '", path, "': read failed");
    if (!any) break;
    ++number;
    offset += length;
    const std::string where = what + " '" + path + "' line " + std::to_string(number);
    if (length > opt.max_line_bytes) {
      opt.on_bad_line(number, str(where, ": longer than ", opt.max_line_bytes, " bytes"));
      if (!newline) break;
      continue;
    }
    if (newline) line.pop_back();
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    if (!newline && opt.on_torn) {
      nlohmann::json row;
      try {
        row = parse_json(line, where);
      } catch (const Error&) {
        opt.on_torn(line_start, line);
        break;
      }
      fn(number, row);
      break;
    }
    if (opt.on_bad_line) {
      nlohmann::json row;
      try {
        row = parse_json(line, where);
      } catch (const Error& e) {
        opt.on_bad_line(number, e.what());
        if (!newline) break;
        continue;
      }
      fn(number, row);
    } else {
      fn(number, parse_json(line, where));
    }
    if (!newline) break;
  }
}

std::string repair_torn_jsonl(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || st.st_size == 0) return "";
  LVX_CHECK(S_ISREG(st.st_mode), "output '", path, "' is ", kind_of(st.st_mode),
            ", not a regular file");
  Fd f{::open(path.c_str(), O_RDWR | O_CLOEXEC)};
  LVX_CHECK(f.fd >= 0, "output '", path, "': cannot open (", std::strerror(errno), ")");
  // Find the last newline, reading backwards in chunks.
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  char last = 0;
  LVX_CHECK(::pread(f.fd, &last, 1, static_cast<off_t>(size - 1)) == 1, "output '", path,
            "': read failed");
  if (last == '\n') return "";
  uint64_t cut = 0;  // bytes kept
  std::vector<char> buf(1 << 16);
  for (uint64_t end = size; end > 0 && cut == 0;) {
    const uint64_t begin = end > buf.size() ? end - buf.size() : 0;
    const ssize_t n = ::pread(f.fd, buf.data(), end - begin, static_cast<off_t>(begin));
    LVX_CHECK(n == static_cast<ssize_t>(end - begin), "output '", path, "': read failed");
    for (uint64_t i = end - begin; i-- > 0;)
      if (buf[i] == '\n') {
        cut = begin + i + 1;
        break;
      }
    end = begin;
  }
  std::string fragment(size - cut, '\0');
  LVX_CHECK(::pread(f.fd, fragment.data(), fragment.size(), static_cast<off_t>(cut)) ==
                static_cast<ssize_t>(fragment.size()),
            "output '", path, "': read failed");
  {
    const std::string aside = path + ".torn";
    FILE* t = std::fopen(aside.c_str(), "ab");
    LVX_CHECK(t != nullptr, "cannot write '", aside, "' to keep the torn last line of '", path,
              "'");
    const bool ok = std::fwrite(fragment.data(), 1, fragment.size(), t) == fragment.size() &&
                    std::fputc('\n', t) != EOF;
    const bool closed = std::fclose(t) == 0;
    LVX_CHECK(ok && closed, "cannot write '", aside, "'");
  }
  LVX_CHECK(::ftruncate(f.fd, static_cast<off_t>(cut)) == 0, "output '", path,
            "': cannot cut its torn last line (", std::strerror(errno), ")");
  ::fsync(f.fd);
  return fragment;
}

std::string file_xxh3(const std::string& path) {
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> st(XXH3_createState(),
                                                                     &XXH3_freeState);
  LVX_CHECK(st && XXH3_64bits_reset(st.get()) == XXH_OK, "xxHash: cannot start a checksum");
  read_chunks(path, "file", [&](const char* p, size_t n) { XXH3_64bits_update(st.get(), p, n); });
  return hex16(XXH3_64bits_digest(st.get()));
}

std::string file_keyed_xxh3(const std::string& path, const std::string& secret) {
  LVX_CHECK(secret.size() >= XXH3_SECRET_SIZE_MIN, "xxHash: a secret of ", secret.size(),
            " bytes is shorter than XXH3's ", XXH3_SECRET_SIZE_MIN);
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> st(XXH3_createState(),
                                                                     &XXH3_freeState);
  LVX_CHECK(st && XXH3_128bits_reset_withSecret(st.get(), secret.data(), secret.size()) == XXH_OK,
            "xxHash: cannot start a keyed checksum");
  read_chunks(path, "file", [&](const char* p, size_t n) { XXH3_128bits_update(st.get(), p, n); });
  const XXH128_hash_t h = XXH3_128bits_digest(st.get());
  return hex16(h.high64) + hex16(h.low64);
}

std::string file_fnv1a64(const std::string& path) {
  uint64_t h = 1469598103934665603ULL;
  read_chunks(path, "file", [&](const char* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      h ^= static_cast<unsigned char>(p[i]);
      h *= 1099511628211ULL;
    }
  });
  return hex16(h);
}

void check_name_inside(const std::string& name, const std::string& index_path) {
  LVX_CHECK(!name.empty() && name.find('/') == std::string::npos &&
                name.find('\\') == std::string::npos && name != "." && name != ".." &&
                name.find('\0') == std::string::npos,
            index_path, ": file name '", name,
            "' is not a plain file name in the checkpoint's folder (paths outside it are "
            "refused)");
}

bool verify_manifest(const std::string& dir) {
  const std::string m = (fs::path(dir) / "manifest.json").string();
  struct stat st {};
  if (::stat(m.c_str(), &st) != 0) return false;
  const nlohmann::json j = read_json_file(m, "checkpoint manifest", uint64_t{64} << 20);
  LVX_CHECK(j.is_object() && j.contains("files") && j["files"].is_object(), m,
            ": corrupt (no 'files' object)");
  for (const auto& [file, info] : j["files"].items()) {
    check_name_inside(file, m);
    LVX_CHECK(info.is_object() && info.contains("bytes") && info["bytes"].is_number_unsigned(), m,
              ": corrupt (entry '", file, "' has no byte count)");
    const fs::path p = fs::path(dir) / file;
    uint64_t size = 0;
    try {
      size = check_regular_file(p.string(), "checkpoint file");
    } catch (const Error&) {
      LVX_FAIL(dir, ": corrupt checkpoint: ", file, " is missing or not a regular file");
    }
    const uint64_t want = info["bytes"].get<uint64_t>();
    LVX_CHECK(size == want, dir, ": corrupt checkpoint: ", file, " has ", size,
              " bytes, the manifest says ", want);
    std::string algo, sum, expected;
    if (info.contains("xxh3") && info["xxh3"].is_string()) {
      algo = "xxh3", expected = info["xxh3"].get<std::string>(), sum = file_xxh3(p.string());
    } else if (info.contains("fnv1a64") && info["fnv1a64"].is_string()) {
      algo = "fnv1a64", expected = info["fnv1a64"].get<std::string>();
      sum = file_fnv1a64(p.string());
    } else {
      LVX_FAIL(m, ": corrupt (entry '", file, "' has no checksum)");
    }
    LVX_CHECK(sum == expected, dir, ": corrupt checkpoint: ", file, " has ", algo, " checksum ",
              sum, ", the manifest says ", expected);
  }
  return true;
}

}  // namespace lvx
