// Uploads as files; see upload.h.
#include "src/serve/upload.h"

#include <stdlib.h>
#include <xxhash.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "src/common/error.h"

namespace lvx::serve {

namespace fs = std::filesystem;

UploadDir::~UploadDir() {
  if (dir_.empty()) return;
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

std::string UploadDir::write(const std::string& bytes, const std::string& file) {
  if (dir_.empty()) {
    // The name client_error_text recognises (openai_api.h): errors say "the uploaded video".
    std::string tmpl = (fs::temp_directory_path() / "lvx-serve-XXXXXX").string();
    LVX_CHECK(::mkdtemp(tmpl.data()) != nullptr, "cannot make a temporary folder in ",
              fs::temp_directory_path().string());
    dir_ = tmpl;
  }
  const std::string path = (fs::path(dir_) / file).string();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  LVX_CHECK(f.good(), "cannot write the upload (", bytes.size(), " bytes) to ", path);
  return path;
}

void UploadDir::spill(MediaRef& m, const std::string& name) {
  if (m.bytes.empty()) return;
  m.path = write(m.bytes, name + m.ext);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(XXH3_64bits(m.bytes.data(), m.bytes.size())));
  m.hash = hex;
  m.upload = true;
  std::string().swap(m.bytes);
}

void spill_uploads(ChatRequest& r, UploadDir& dir) {
  if (r.video) dir.spill(*r.video, "video");
  for (size_t i = 0; i < r.frames.size(); ++i) dir.spill(r.frames[i], "frame" + std::to_string(i));
}

}  // namespace lvx::serve
