// Uploads as files, as soon as a request is read (rank 0): the media a request sent inline go into
// a folder of its own (mkdtemp: unpredictable, mode 0700), and the request keeps their paths and
// content hashes instead of their bytes, so a queued or running request holds a file, not memory.
// Ranks on rank 0's machine read those files; only ranks elsewhere get the bytes (wire.h). The
// folder goes when the request does (its answer sent, its generation gone).
#pragma once

#include <string>

#include "src/serve/openai_api.h"

namespace lvx::serve {

class UploadDir {
 public:
  UploadDir() = default;
  UploadDir(const UploadDir&) = delete;
  UploadDir& operator=(const UploadDir&) = delete;
  ~UploadDir();
  // Writes `bytes` to the file `file` in the folder (made on first use); returns its path.
  // Throws lvx::Error naming what failed (the folder, the write).
  std::string write(const std::string& bytes, const std::string& file);
  // Decodes `m`'s data URL (its base64) straight into `name` + its extension in the folder (made
  // on first use), hashing the bytes as they go, then holds the file instead: m.path, m.hash
  // (XXH3-64 of the bytes), m.upload; m.base64 emptied. Malformed base64: a 400 (ApiError).
  void spill(MediaRef& m, const std::string& name);

 private:
  // The path of `file` in the folder, made on first use.
  std::string path_of(const std::string& file);
  std::string dir_;
};

// Every inline medium of `r` into `dir` ("video", "frame0", "frame1", ...).
void spill_uploads(ChatRequest& r, UploadDir& dir);

}  // namespace lvx::serve
