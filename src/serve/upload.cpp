// Uploads as files; see upload.h.
#include "src/serve/upload.h"

#include <stdlib.h>
#include <xxhash.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "src/common/error.h"
#include "src/runtime/qa_media.h"

namespace lvx::serve {

namespace fs = std::filesystem;

UploadDir::~UploadDir() {
  if (dir_.empty()) return;
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

std::string UploadDir::path_of(const std::string& file) {
  if (dir_.empty()) {
    // The name client_error_text recognises (openai_api.h): errors say "the uploaded video".
    std::string tmpl = (fs::temp_directory_path() / "lvx-serve-XXXXXX").string();
    LVX_CHECK(::mkdtemp(tmpl.data()) != nullptr, "cannot make a temporary folder in ",
              fs::temp_directory_path().string());
    dir_ = tmpl;
  }
  return (fs::path(dir_) / file).string();
}

std::string UploadDir::write(const std::string& bytes, const std::string& file) {
  const std::string path = path_of(file);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  LVX_CHECK(f.good(), "cannot write the upload (", bytes.size(), " bytes) to ", path);
  return path;
}

void UploadDir::spill(MediaRef& m, const std::string& name) {
  if (m.base64.empty()) return;
  const std::string path = path_of(name + m.ext);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  // Keyed by the session's content secret (runtime/qa_media.h): identical uploads share a
  // generation by this hash, so no client may choose two contents of one hash.
  const std::string secret = runtime::content_secret();
  XXH3_state_t* state = XXH3_createState();
  LVX_CHECK(state != nullptr &&
                XXH3_128bits_reset_withSecret(state, secret.data(), secret.size()) == XXH_OK,
            "cannot hash the upload");
  int64_t bytes = 0;
  const bool ok = base64_decode(m.base64, [&](std::string_view piece) {
    f.write(piece.data(), static_cast<std::streamsize>(piece.size()));
    XXH3_128bits_update(state, piece.data(), piece.size());
    bytes += static_cast<int64_t>(piece.size());
  });
  const XXH128_hash_t hash = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  std::string().swap(m.base64);  // the text is done with, written or not
  if (!ok)
    throw bad_request(m.field + ": the data URL's base64 is malformed",
                      "messages[].content[]." + m.field);
  LVX_CHECK(f.good(), "cannot write the upload (", bytes, " bytes) to ", path);
  char hex[33];
  std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(hash.high64),
                static_cast<unsigned long long>(hash.low64));
  m.path = path;
  m.hash = hex;
  m.upload = true;
}

void spill_uploads(ChatRequest& r, UploadDir& dir) {
  if (r.video) dir.spill(*r.video, "video");
  for (size_t i = 0; i < r.frames.size(); ++i) dir.spill(r.frames[i], "frame" + std::to_string(i));
}

}  // namespace lvx::serve
