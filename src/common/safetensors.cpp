// Safetensors reader/writer (format described in safetensors.h).
#include "src/common/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <unistd.h>

#include "src/common/error.h"

namespace lvx {
namespace {

struct DtypeCode {
  const char* code;
  at::ScalarType type;
};
constexpr DtypeCode kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat},  {"F16", at::kHalf},  {"BF16", at::kBFloat16},
    {"I64", at::kLong},   {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},
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

TensorFile load_safetensors(const std::string& path, const std::vector<std::string>& names) {
  std::ifstream in(path, std::ios::binary);
  LVX_CHECK(in.good(), path, ": cannot open (", std::strerror(errno), ")");
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  uint64_t header_len = 0;
  LVX_CHECK(file_size >= 8, path, ": not a safetensors file (", file_size, " bytes)");
  in.read(reinterpret_cast<char*>(&header_len), 8);
  LVX_CHECK(header_len <= file_size - 8, path, ": header length ", header_len,
            " exceeds the file size ", file_size, " (truncated or not safetensors)");
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    LVX_FAIL(path, ": header is not valid JSON: ", e.what());
  }
  const uint64_t data_begin = 8 + header_len;
  TensorFile out;
  std::set<std::string> wanted(names.begin(), names.end());
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      for (auto m = it.value().begin(); m != it.value().end(); ++m)
        out.metadata[m.key()] = m.value().is_string() ? m.value().get<std::string>()
                                                      : m.value().dump();
      continue;
    }
    if (!wanted.empty() && !wanted.count(it.key())) continue;
    const auto& e = it.value();
    const at::ScalarType type = scalar_type_from_safetensors(e.at("dtype").get<std::string>());
    std::vector<int64_t> shape = e.at("shape").get<std::vector<int64_t>>();
    const auto offs = e.at("data_offsets").get<std::vector<uint64_t>>();
    LVX_CHECK(offs.size() == 2 && offs[0] <= offs[1], path, ": tensor '", it.key(),
              "' has bad data_offsets");
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
    const uint64_t nbytes = t.numel() * t.element_size();
    LVX_CHECK(offs[1] - offs[0] == nbytes, path, ": tensor '", it.key(), "' holds ",
              offs[1] - offs[0], " bytes but its shape and dtype need ", nbytes);
    LVX_CHECK(data_begin + offs[1] <= file_size, path, ": tensor '", it.key(),
              "' lies past the end of the file (truncated)");
    in.seekg(static_cast<std::streamoff>(data_begin + offs[0]));
    in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(nbytes));
    LVX_CHECK(in.good(), path, ": short read for tensor '", it.key(), "'");
    out.tensors[it.key()] = t;
  }
  for (const auto& n : wanted)
    LVX_CHECK(out.tensors.count(n), path, ": has no tensor named '", n, "'");
  return out;
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  nlohmann::json j = nlohmann::json::object();
  if (!metadata.empty()) j["__metadata__"] = metadata;
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, t0] : tensors) {  // std::map: sorted names, deterministic files
    at::Tensor t = t0.detach().to(at::kCPU).contiguous();
    const uint64_t nbytes = t.numel() * t.element_size();
    j[name] = {{"dtype", safetensors_dtype(t.scalar_type())},
               {"shape", t.sizes().vec()},
               {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    data.push_back(t);
  }
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // align data to 8 bytes, as HF does
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    LVX_CHECK(out.good(), path, ": cannot write (", std::strerror(errno), ")");
    const uint64_t len = header.size();
    out.write(reinterpret_cast<const char*>(&len), 8);
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    for (const auto& t : data)
      out.write(static_cast<const char*>(t.data_ptr()),
                static_cast<std::streamsize>(t.numel() * t.element_size()));
    out.flush();
    LVX_CHECK(out.good(), path, ": write failed (disk full?)");
  }
  std::filesystem::rename(tmp, path);
}

std::map<std::string, at::Tensor> load_checkpoint_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::map<std::string, at::Tensor> out;
  if (!fs::exists(index)) {
    const fs::path single = fs::path(dir) / "model.safetensors";
    LVX_CHECK(fs::exists(single), dir, ": no model.safetensors or model.safetensors.index.json");
    return load_safetensors(single.string()).tensors;
  }
  std::ifstream in(index);
  nlohmann::json j = nlohmann::json::parse(in);
  std::map<std::string, std::vector<std::string>> by_shard;
  for (auto it = j.at("weight_map").begin(); it != j.at("weight_map").end(); ++it)
    by_shard[it.value().get<std::string>()].push_back(it.key());
  for (const auto& [shard, names] : by_shard) {
    auto f = load_safetensors((fs::path(dir) / shard).string(), names);
    for (auto& [n, t] : f.tensors) out[n] = t;
  }
  return out;
}

}  // namespace lvx
