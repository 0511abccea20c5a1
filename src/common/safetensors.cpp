// Safetensors reader/writer (format described in safetensors.h).
#include "src/common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "src/common/error.h"
#include "src/common/files.h"

namespace lvx {
namespace {

struct DtypeCode {
  const char* code;
  at::ScalarType type;
};
constexpr DtypeCode kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
    {"U8", at::kByte},    {"BOOL", at::kBool},
};

}  // namespace

std::string safetensors_dtype(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.code;
  LVX_FAIL("safetensors: dtype ", c10::toString(t), " cannot be stored");
}

at::ScalarType scalar_type_from_safetensors(const std::string& code) {
  for (const auto& d : kDtypes)
    if (code == d.code) return d.type;
  LVX_FAIL("safetensors: unknown dtype code '", code, "'");
}

namespace {

// The safetensors package's bound on a header (100 MB): a larger length is a lie or a
// different format, and is refused before anything is allocated from it.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// pread until `n` bytes are in or the file ends; false on a short read.
bool pread_all(int fd, void* dst, uint64_t n, uint64_t offset) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, uint64_t{1} << 30));
    const ssize_t got = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
  return true;
}

// The header's JSON: nesting bounded (kMaxJsonDepth) and duplicate keys refused at every level
// (nlohmann keeps one of two entries with one name silently; the safetensors package refuses
// them). A SAX pass checks both in linear time (nlohmann's parse callback rescans the enclosing
// object at the end of every member: quadratic in a header of many tensors), then the parse.
class HeaderCheck : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit HeaderCheck(const std::string& path) : path_(path) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    open(true);
    return true;
  }
  bool key(string_t& k) override {
    LVX_CHECK(keys_.back().insert(k).second, path_, ": header names '", k,
              "' twice (a duplicate tensor or field)");
    return true;
  }
  bool end_object() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override {
    open(false);
    return true;
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    LVX_FAIL(path_, ": header is not valid JSON (", e.what(), ")");
  }

 private:
  void open(bool object) {
    LVX_CHECK(++depth_ <= kMaxJsonDepth, path_, ": header: JSON nested deeper than ", kMaxJsonDepth,
              " levels");
    if (object) keys_.emplace_back();
  }
  const std::string& path_;
  int depth_ = 0;
  std::vector<std::set<std::string>> keys_;  // the keys of each open object
};

nlohmann::json parse_header(const std::string& text, const std::string& path) {
  HeaderCheck check(path);
  nlohmann::json::sax_parse(text, &check);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    LVX_FAIL(path, ": header is not valid JSON (", e.what(), ")");
  }
}

using Entry = SafetensorsHeader::Entry;

// One tensor's header entry, every field checked; nbytes = product(shape) · element size must
// not overflow and must be the span of its offsets.
Entry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& e) {
  const std::string where = path + ": tensor '" + name + "'";
  LVX_CHECK(e.is_object(), where, ": expected an object with dtype, shape and data_offsets, got ",
            e.type_name());
  Entry out;
  out.name = name;
  LVX_CHECK(e.contains("dtype") && e["dtype"].is_string(), where, ": dtype: missing or not a ",
            "string");
  const std::string code = e["dtype"].get<std::string>();
  bool known = false;
  for (const auto& d : kDtypes)
    if (code == d.code) known = true, out.type = d.type;
  LVX_CHECK(known, where, ": dtype '", code, "' is not supported (F64, F32, F16, BF16, I64, I32, ",
            "I16, I8, U8, BOOL)");
  LVX_CHECK(e.contains("shape") && e["shape"].is_array(), where, ": shape: missing or not an ",
            "array");
  LVX_CHECK(e["shape"].size() <= 64, where, ": shape has ", e["shape"].size(), " dimensions");
  uint64_t nbytes = c10::elementSize(out.type);
  for (const auto& d : e["shape"]) {
    LVX_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0), where,
              ": shape: expected non-negative integers, got ", e["shape"].dump());
    const uint64_t n = d.get<uint64_t>();
    LVX_CHECK(n <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) &&
                  !__builtin_mul_overflow(nbytes, n, &nbytes),
              where, ": shape ", e["shape"].dump(), " is too large (its size overflows)");
    out.shape.push_back(static_cast<int64_t>(n));
  }
  LVX_CHECK(e.contains("data_offsets") && e["data_offsets"].is_array() &&
                e["data_offsets"].size() == 2 && e["data_offsets"][0].is_number_unsigned() &&
                e["data_offsets"][1].is_number_unsigned(),
            where, ": data_offsets: expected [begin, end] (non-negative integers), got ",
            e.contains("data_offsets") ? e["data_offsets"].dump() : std::string("nothing"));
  out.begin = e["data_offsets"][0].get<uint64_t>();
  out.end = e["data_offsets"][1].get<uint64_t>();
  LVX_CHECK(out.begin <= out.end, where, ": data_offsets [", out.begin, ", ", out.end,
            "] end before they begin");
  LVX_CHECK(out.end - out.begin == nbytes, where, ": data_offsets [", out.begin, ", ", out.end,
            "] hold ", out.end - out.begin, " bytes but its shape ", e["shape"].dump(),
            " and dtype ", code, " need ", nbytes);
  return out;
}

}  // namespace

namespace {

// Opens `path` (a regular file only: a FIFO cannot block the open, O_NONBLOCK, and is refused by
// fstat) and validates its whole header before anything is allocated from it: every entry, then
// the layout of the data section (sorted, non-overlapping, covering it exactly: no gap, no
// trailing bytes). Returns the open file.
Fd open_and_validate(const std::string& path, SafetensorsHeader* out) {
  Fd f(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  LVX_CHECK(f.fd >= 0, path, ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  LVX_CHECK(::fstat(f.fd, &st) == 0, path, ": cannot stat (", std::strerror(errno), ")");
  LVX_CHECK(S_ISREG(st.st_mode), path, ": is ",
            S_ISDIR(st.st_mode)    ? "a directory"
            : S_ISFIFO(st.st_mode) ? "a FIFO"
                                   : "not a regular file",
            ", not a safetensors file");
  ::fcntl(f.fd, F_SETFL, ::fcntl(f.fd, F_GETFL) & ~O_NONBLOCK);
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  LVX_CHECK(file_size >= 8, path, ": not a safetensors file (", file_size, " bytes)");
  unsigned char len_bytes[8];
  LVX_CHECK(pread_all(f.fd, len_bytes, 8, 0), path, ": cannot read its header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];  // little-endian
  LVX_CHECK(header_len <= file_size - 8, path, ": header length ", header_len,
            " exceeds the file size ", file_size, " (truncated or not safetensors)");
  LVX_CHECK(header_len <= kMaxHeaderBytes, path, ": header length ", header_len,
            " is more than the ", kMaxHeaderBytes, " bytes a safetensors header may have");
  std::string header(header_len, '\0');
  LVX_CHECK(pread_all(f.fd, header.data(), header_len, 8), path, ": short read of its header");
  const size_t first = header.find_first_not_of(" \t\r\n");
  LVX_CHECK(first != std::string::npos && header[first] == '{', path,
            ": header is not a JSON object (not a safetensors file)");
  const nlohmann::json j = parse_header(header, path);
  LVX_CHECK(j.is_object(), path, ": header is not a JSON object");

  out->path = path;
  out->data_begin = 8 + header_len;
  const uint64_t data_len = file_size - out->data_begin;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      LVX_CHECK(it.value().is_object(), path, ": __metadata__ must be an object of strings");
      for (auto m = it.value().begin(); m != it.value().end(); ++m)
        out->metadata[m.key()] =
            m.value().is_string() ? m.value().get<std::string>() : m.value().dump();
      continue;
    }
    out->entries.push_back(parse_entry(path, it.key(), it.value()));
  }
  std::vector<const Entry*> by_offset;
  for (const Entry& e : out->entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t at = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : by_offset) {
    LVX_CHECK(e->begin <= at, path, ": tensor '", e->name, "' begins at byte ", e->begin,
              " of the data but ", prev ? "tensor '" + prev->name + "' ends at " : "the data ",
              prev ? "" : "begins at ", at, " (a gap: offsets must cover the data exactly)");
    LVX_CHECK(e->begin == at, path, ": tensors '", prev ? prev->name : "", "' and '", e->name,
              "' overlap (bytes [", e->begin, ", ", at, ") are shared)");
    at = e->end;
    prev = e;
  }
  LVX_CHECK(at <= data_len, path, ": tensor '", prev ? prev->name : "", "' ends at byte ", at,
            " of the data but the file holds only ", data_len,
            " data bytes (truncated, or a wrong header length)");
  LVX_CHECK(at == data_len, path, ": ", data_len - at, " bytes after the last tensor's data (",
            "the offsets cover ", at, " of ", data_len,
            " bytes: a wrong header length or trailing garbage)");
  return f;
}

at::Tensor read_entry(int fd, const SafetensorsHeader& h, const Entry& e) {
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.type));
  LVX_CHECK(pread_all(fd, t.data_ptr(), e.end - e.begin, h.data_begin + e.begin), h.path,
            ": short read for tensor '", e.name, "' (the file changed while it was read?)");
  return t;
}

}  // namespace

class MappedSafetensors {
 public:
  explicit MappedSafetensors(const SafetensorsHeader& h) : header_(h) {
    Fd f(::open(h.path.c_str(), O_RDONLY | O_CLOEXEC));
    LVX_CHECK(f.fd >= 0, h.path, ": cannot open (", std::strerror(errno), ")");
    struct stat st {};
    LVX_CHECK(::fstat(f.fd, &st) == 0, h.path, ": cannot stat (", std::strerror(errno), ")");
    uint64_t end = h.data_begin;
    for (const Entry& e : h.entries) end = std::max(end, h.data_begin + e.end);
    LVX_CHECK(static_cast<uint64_t>(st.st_size) >= end, h.path, ": ", st.st_size,
              " bytes, but its header describes ", end, " (truncated since it was read?)");
    size_ = static_cast<size_t>(st.st_size);
    if (size_ == 0) return;
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, f.fd, 0);
    LVX_CHECK(p != MAP_FAILED, h.path, ": cannot map ", size_, " bytes (", std::strerror(errno),
              ")");
    base_ = static_cast<char*>(p);
  }
  ~MappedSafetensors() {
    if (base_ != nullptr) ::munmap(base_, size_);
  }
  MappedSafetensors(const MappedSafetensors&) = delete;
  MappedSafetensors& operator=(const MappedSafetensors&) = delete;
  const SafetensorsHeader& header() const { return header_; }
  char* data(const Entry& e) const { return base_ + header_.data_begin + e.begin; }

 private:
  SafetensorsHeader header_;
  char* base_ = nullptr;
  size_t size_ = 0;
};

std::shared_ptr<const MappedSafetensors> map_safetensors(const SafetensorsHeader& header) {
  return std::make_shared<const MappedSafetensors>(header);
}

namespace {

// The whole pages inside [p, p + n) (madvise works on pages; a partial page at either end may
// hold a neighbour's bytes).
std::pair<char*, size_t> pages_inside(char* p, size_t n) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + n) & ~(page - 1);
  return b > a ? std::make_pair(reinterpret_cast<char*>(a), static_cast<size_t>(b - a))
               : std::make_pair(static_cast<char*>(nullptr), size_t{0});
}

// The pages covering [p, p + n), outward (to read them in).
std::pair<char*, size_t> pages_covering(char* p, size_t n) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~(page - 1);
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + n + page - 1) & ~(page - 1);
  return {reinterpret_cast<char*>(a), static_cast<size_t>(b - a)};
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

}  // namespace

at::Tensor mapped_tensor(const std::shared_ptr<const MappedSafetensors>& file,
                         const std::string& name, bool populate) {
  const SafetensorsHeader& h = file->header();
  const auto it = std::find_if(h.entries.begin(), h.entries.end(),
                               [&](const Entry& e) { return e.name == name; });
  LVX_CHECK(it != h.entries.end(), h.path, ": has no tensor named '", name, "'");
  char* p = file->data(*it);
  const size_t n = static_cast<size_t>(it->end - it->begin);
  const auto options = at::TensorOptions().dtype(it->type);
  if (n == 0) return at::empty(it->shape, options);
  if (populate) {
    const auto [a, len] = pages_covering(p, n);
    if (::madvise(a, len, MADV_POPULATE_READ) != 0)  // older kernels: a hint, then the faults
      ::madvise(a, len, MADV_WILLNEED);
  }
  if (reinterpret_cast<uintptr_t>(p) % c10::elementSize(it->type) != 0) {
    at::Tensor t = at::empty(it->shape, options);
    std::memcpy(t.data_ptr(), p, n);
    return t;
  }
  auto keep = new std::shared_ptr<const MappedSafetensors>(file);
  return at::from_blob(
      p, it->shape, [keep](void*) { delete keep; }, options);
}

void release_mapped_pages(const at::Tensor& mapped) {
  if (!mapped.defined() || mapped.numel() == 0) return;
  const auto [a, len] = pages_inside(static_cast<char*>(mapped.data_ptr()),
                                     static_cast<size_t>(mapped.nbytes()));
  if (len > 0) ::madvise(a, len, MADV_DONTNEED);
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  SafetensorsHeader h;
  open_and_validate(path, &h);
  return h;
}

at::Tensor read_safetensors_tensor(const SafetensorsHeader& header, const std::string& name) {
  const auto it = std::find_if(header.entries.begin(), header.entries.end(),
                               [&](const Entry& e) { return e.name == name; });
  LVX_CHECK(it != header.entries.end(), header.path, ": has no tensor named '", name, "'");
  Fd f(::open(header.path.c_str(), O_RDONLY | O_CLOEXEC));
  LVX_CHECK(f.fd >= 0, header.path, ": cannot open (", std::strerror(errno), ")");
  return read_entry(f.fd, header, *it);
}

TensorFile load_safetensors(const std::string& path, const std::vector<std::string>& names) {
  SafetensorsHeader h;
  const Fd f = open_and_validate(path, &h);
  TensorFile out;
  out.metadata = h.metadata;
  std::set<std::string> wanted(names.begin(), names.end());
  for (const Entry& e : h.entries)
    if (wanted.empty() || wanted.count(e.name)) out.tensors[e.name] = read_entry(f.fd, h, e);
  for (const auto& n : wanted)
    LVX_CHECK(out.tensors.count(n), path, ": has no tensor named '", n, "'");
  return out;
}

uint64_t SafetensorsWriter::nbytes(const Spec& s) {
  uint64_t n = c10::elementSize(s.type);
  for (int64_t d : s.shape) n *= static_cast<uint64_t>(d);
  return n;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<Spec> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), specs_(std::move(tensors)) {
  nlohmann::json j = nlohmann::json::object();
  if (!metadata.empty()) j["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const Spec& t : specs_) {
    LVX_CHECK(!j.contains(t.name), path_, ": tensor '", t.name, "' given twice");
    const uint64_t n = nbytes(t);
    j[t.name] = {{"dtype", safetensors_dtype(t.type)},
                 {"shape", t.shape},
                 {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // align data to 8 bytes, as HF does
  tmp_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LVX_CHECK(fd_ >= 0, path_, ": cannot write (", std::strerror(errno), ")");
  const uint64_t len = header.size();
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(len >> (8 * i));
  write_all(len_bytes, 8);
  write_all(header.data(), header.size());
  while (current_ < specs_.size() && nbytes(specs_[current_]) == 0) ++current_;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void SafetensorsWriter::write_all(const void* data, uint64_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t got = ::write(fd_, p, static_cast<size_t>(std::min<uint64_t>(n, 1u << 30)));
    if (got < 0 && errno == EINTR) continue;
    LVX_CHECK(got > 0, path_, ": write failed (", std::strerror(errno), "; disk full?)");
    p += got;
    n -= static_cast<uint64_t>(got);
  }
}

void SafetensorsWriter::write(const at::Tensor& piece) {
  LVX_CHECK(current_ < specs_.size(), path_, ": more data than the header's tensors hold");
  const Spec& s = specs_[current_];
  LVX_CHECK(piece.device().is_cpu() && piece.is_contiguous() && piece.scalar_type() == s.type,
            path_, ": tensor '", s.name, "': expected a contiguous CPU ", s.type, " piece, got ",
            piece.scalar_type(), " on ", piece.device());
  const uint64_t n = piece.numel() * piece.element_size(), total = nbytes(s);
  LVX_CHECK(written_ + n <= total, path_, ": tensor '", s.name, "': ", written_ + n,
            " bytes given for ", total);
  write_all(piece.data_ptr(), n);
  written_ += n;
  if (written_ == total) {
    written_ = 0;
    for (++current_; current_ < specs_.size() && nbytes(specs_[current_]) == 0;) ++current_;
  }
}

void SafetensorsWriter::finish() {
  LVX_CHECK(current_ == specs_.size(), path_, ": tensor '",
            current_ < specs_.size() ? specs_[current_].name : "", "' was not written whole");
  const int fd = fd_;
  fd_ = -1;
  LVX_CHECK(::close(fd) == 0, path_, ": close failed (", std::strerror(errno), ")");
  std::filesystem::rename(tmp_, path_);
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::Spec> specs;
  std::vector<at::Tensor> data;
  for (const auto& [name, t0] : tensors) {  // std::map: sorted names, deterministic files
    data.push_back(t0.detach().to(at::kCPU).contiguous());
    specs.push_back({name, data.back().scalar_type(), data.back().sizes().vec()});
  }
  SafetensorsWriter w(path, std::move(specs), metadata);
  for (const at::Tensor& t : data)
    if (t.numel() > 0) w.write(t);
  w.finish();
}

std::map<std::string, std::vector<std::string>> checkpoint_shards(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (!fs::exists(index)) {
    const fs::path single = fs::path(dir) / "model.safetensors";
    LVX_CHECK(fs::exists(single), dir, ": no model.safetensors or model.safetensors.index.json");
    return {{single.string(), {}}};
  }
  const nlohmann::json j = read_json_file(index.string(), "checkpoint index");
  LVX_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
            index.string(), ": weight_map: missing or not an object (tensor name -> shard file)");
  std::map<std::string, std::vector<std::string>> by_shard;
  for (const auto& [name, file] : j["weight_map"].items()) {
    LVX_CHECK(file.is_string(), index.string(), ": weight_map: '", name,
              "' must name a shard file, got ", file.dump());
    // Shards live in the checkpoint's own folder: "../x" or "/etc/x" is refused.
    check_name_inside(file.get<std::string>(), index.string());
    by_shard[(fs::path(dir) / file.get<std::string>()).string()].push_back(name);
  }
  return by_shard;
}

std::map<std::string, at::Tensor> load_checkpoint_dir(const std::string& dir) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [shard, names] : checkpoint_shards(dir)) {
    auto f = load_safetensors(shard, names);
    for (auto& [n, t] : f.tensors) out[n] = t;
  }
  return out;
}

}  // namespace lvx
