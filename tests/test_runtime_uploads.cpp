// lvx serve's uploads (src/serve/upload.h): a data URL's base64 is decoded straight into its file,
// piece by piece, never held decoded; the file's bytes and content hash are the payload's, and
// malformed base64 is a 400 that leaves no file behind. Independent reference: the payload itself
// (its bytes and XXH3-64) and a base64 encoder written here.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "src/runtime/qa_media.h"
#include "src/serve/openai_api.h"
#include "src/serve/upload.h"

namespace {

namespace fs = std::filesystem;
using lvx::serve::MediaRef;
using lvx::serve::UploadDir;

std::string encode(const std::string& bytes) {
  static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    uint32_t v = static_cast<uint8_t>(bytes[i]) << 16;
    if (i + 1 < bytes.size()) v |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    if (i + 2 < bytes.size()) v |= static_cast<uint8_t>(bytes[i + 2]);
    out += a[(v >> 18) & 63];
    out += a[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? a[(v >> 6) & 63] : '=';
    out += i + 2 < bytes.size() ? a[v & 63] : '=';
  }
  return out;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// 2.5 MiB of random bytes (three 1 MiB decode pieces) and 1–3 byte payloads (every padding).
TEST(Uploads, DataUrlsAreDecodedStraightIntoTheirFiles) {
  std::mt19937 rng(7);
  for (size_t size : {size_t{1}, size_t{2}, size_t{3}, size_t{5} << 19}) {
    std::string bytes(size, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    UploadDir dir;
    MediaRef m;
    m.base64 = encode(bytes);
    m.ext = ".mp4";
    m.field = "video_url";
    dir.spill(m, "video");
    ASSERT_TRUE(m.upload);
    EXPECT_TRUE(m.base64.empty());  // the text is given back
    EXPECT_EQ(slurp(m.path), bytes) << size;
    // The hash is the session's keyed one (runtime/qa_media.h): XXH3-128 under its secret.
    const std::string secret = lvx::runtime::content_secret();
    const XXH128_hash_t h =
        XXH3_128bits_withSecret(bytes.data(), bytes.size(), secret.data(), secret.size());
    char hex[33];
    std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                  static_cast<unsigned long long>(h.low64));
    EXPECT_EQ(m.hash, hex);
  }
}

TEST(Uploads, MalformedBase64IsA400AndLeavesNoFile) {
  std::string folder;
  {
    UploadDir dir;
    MediaRef m;
    m.base64 = encode(std::string(3000, 'x')) + "*AAA";  // a bad character after good pieces
    m.ext = ".png";
    m.field = "image_url";
    try {
      dir.spill(m, "frame0");
      FAIL() << "malformed base64 was accepted";
    } catch (const lvx::serve::ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_NE(std::string(e.what()).find("image_url: the data URL's base64 is malformed"),
                std::string::npos)
          << e.what();
    }
    EXPECT_FALSE(m.upload);
    EXPECT_TRUE(m.base64.empty());
    for (const auto& p : fs::directory_iterator(fs::temp_directory_path()))
      if (p.path().filename().string().rfind("lvx-serve-", 0) == 0 &&
          fs::exists(p.path() / "frame0.png"))
        folder = p.path().string();
  }
  ASSERT_FALSE(folder.empty()) << "the upload's folder was not made";
  EXPECT_FALSE(fs::exists(folder)) << folder;  // removed with the dir, the partial file with it
}

}  // namespace
