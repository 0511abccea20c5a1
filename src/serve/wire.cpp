#include "src/serve/wire.h"

#include <cstring>

#include "src/common/error.h"

namespace lvx::serve {

namespace {

void put_u64(std::string& out, uint64_t v) {
  char b[8];
  std::memcpy(b, &v, 8);
  out.append(b, 8);
}

uint64_t get_u64(const std::string& in, size_t& at) {
  LVX_CHECK(at + 8 <= in.size(), "serve command: truncated at byte ", at, " of ", in.size());
  uint64_t v = 0;
  std::memcpy(&v, in.data() + at, 8);
  at += 8;
  return v;
}

std::string get_bytes(const std::string& in, size_t& at) {
  const uint64_t n = get_u64(in, at);
  LVX_CHECK(n <= in.size() - at, "serve command: a field of ", n, " bytes at byte ", at, " of ",
            in.size());
  std::string s = in.substr(at, n);
  at += n;
  return s;
}

}  // namespace

std::string pack(const Command& c) {
  std::string out;
  put_u64(out, static_cast<uint64_t>(c.op));
  const std::string d = c.desc.dump();
  put_u64(out, d.size());
  out += d;
  put_u64(out, c.blobs.size());
  for (const std::string& b : c.blobs) {
    put_u64(out, b.size());
    out += b;
  }
  return out;
}

Command unpack(const std::string& in) {
  size_t at = 0;
  Command c;
  c.op = static_cast<Op>(get_u64(in, at));
  c.desc = nlohmann::json::parse(get_bytes(in, at));
  const uint64_t n = get_u64(in, at);
  for (uint64_t i = 0; i < n; ++i) c.blobs.push_back(get_bytes(in, at));
  return c;
}

void exchange(dist::ProcessGroup& pg, Command& c) {
  std::string bytes;
  at::Tensor len = at::zeros({1}, at::kLong);
  if (pg.rank() == 0) {
    bytes = pack(c);
    len[0] = static_cast<int64_t>(bytes.size());
  }
  pg.broadcast(len, 0);
  at::Tensor data = at::empty({len[0].item<int64_t>()}, at::kByte);
  if (pg.rank() == 0) std::memcpy(data.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  pg.broadcast(data, 0);
  if (pg.rank() != 0) {
    bytes.assign(reinterpret_cast<const char*>(data.data_ptr<uint8_t>()),
                 static_cast<size_t>(data.numel()));
    c = unpack(bytes);
  }
  if (c.op == Op::kHeartbeat) pg.barrier();
}

}  // namespace lvx::serve
