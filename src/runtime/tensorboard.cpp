// TensorBoard event files; see tensorboard.h.
#include "src/runtime/tensorboard.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "src/common/error.h"

namespace lvx::runtime {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <typename T>
void little_endian(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86-64 and aarch64 are little endian
  out.append(b, sizeof(T));
}

// A length-delimited field: tag (field << 3 | 2), length, bytes.
void bytes_field(std::string& out, int field, const std::string& v) {
  varint(out, static_cast<uint64_t>(field) << 3 | 2);
  varint(out, v.size());
  out += v;
}

// Event { wall_time = 1, step = 2 } with `tail` (its remaining fields) appended.
std::string event(int64_t step, const std::string& tail) {
  std::string e;
  varint(e, 1 << 3 | 1);
  little_endian(e, now_seconds());
  varint(e, 2 << 3 | 0);
  varint(e, static_cast<uint64_t>(step));
  return e + tail;
}

std::string host_name() {
  char h[256] = {0};
  return ::gethostname(h, sizeof(h) - 1) == 0 && h[0] != '\0' ? h : "localhost";
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  LVX_CHECK(!ec, "logging.tensorboard: cannot create ", dir, ": ", ec.message());
  path_ = dir + "/events.out.tfevents." +
          std::to_string(static_cast<int64_t>(now_seconds())) + "." + host_name() + ".lvx";
  out_.open(path_, std::ios::binary | std::ios::app);
  LVX_CHECK(out_.good(), "logging.tensorboard: cannot write ", path_);
  std::string version;
  bytes_field(version, 3, "brain.Event:2");
  record(event(0, version));
}

void TensorBoardWriter::record(const std::string& data) {
  std::string r;
  const uint64_t n = data.size();
  little_endian(r, n);
  little_endian(r, masked_crc32c(r.data(), 8));
  r += data;
  little_endian(r, masked_crc32c(data.data(), data.size()));
  out_.write(r.data(), static_cast<std::streamsize>(r.size()));
  out_.flush();
  LVX_CHECK(out_.good(), "logging.tensorboard: cannot write ", path_);
}

void TensorBoardWriter::scalar(const std::string& tag, int64_t step, double value) {
  std::string v;
  bytes_field(v, 1, tag);
  varint(v, 2 << 3 | 5);
  little_endian(v, static_cast<float>(value));
  std::string summary;
  bytes_field(summary, 1, v);
  std::string tail;
  bytes_field(tail, 5, summary);
  record(event(step, tail));
}

void TensorBoardWriter::metrics(const nlohmann::json& line, const std::string& prefix) {
  const int64_t step = line.value("step", int64_t{0});
  for (const auto& [k, v] : line.items())
    if (k != "step" && v.is_number()) scalar(prefix + k, step, v.get<double>());
}

}  // namespace lvx::runtime
