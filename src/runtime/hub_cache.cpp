#include "src/runtime/hub_cache.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

#include "src/common/error.h"

namespace fs = std::filesystem;

namespace lvx::runtime {

bool is_hub_name(const std::string& name) {
  static const std::regex re(
      R"(^[A-Za-z0-9_-][A-Za-z0-9._-]*/[A-Za-z0-9._-]+(@[A-Za-z0-9._/-]+)?$)");
  return std::regex_match(name, re);
}

std::string hub_cache_dir() {
  if (const char* c = std::getenv("HF_HUB_CACHE"); c && *c) return c;
  if (const char* h = std::getenv("HF_HOME"); h && *h) return (fs::path(h) / "hub").string();
  const char* home = std::getenv("HOME");
  return (fs::path(home ? home : "/") / ".cache" / "huggingface" / "hub").string();
}

std::string hub_snapshot(const std::string& name) {
  const size_t at = name.find('@');
  const std::string repo = name.substr(0, at);
  const std::string revision = at == std::string::npos ? "main" : name.substr(at + 1);
  const size_t slash = repo.find('/');
  const fs::path folder = fs::path(hub_cache_dir()) /
                          ("models--" + repo.substr(0, slash) + "--" + repo.substr(slash + 1));
  const std::string fetch = "download it first: huggingface-cli download " + repo +
                            (at == std::string::npos ? "" : " --revision " + revision) +
                            " (or set HF_HUB_CACHE / HF_HOME to the cache that holds it)";
  std::error_code ec;
  LVX_CHECK(fs::is_directory(folder, ec), "--model ", name,
            ": not a folder here, and not in the Hugging Face cache (looked for ", folder.string(),
            "); lvx reads the cache offline and never downloads: ", fetch);
  std::string commit = revision;  // a commit hash names its snapshot itself
  if (std::ifstream ref(folder / "refs" / revision); ref) std::getline(ref, commit);
  const fs::path snapshot = folder / "snapshots" / commit;
  LVX_CHECK(!commit.empty() && fs::is_directory(snapshot, ec), "--model ", name, ": revision '",
            revision, "' is not in the Hugging Face cache (looked for ", snapshot.string(),
            "): ", fetch);
  return snapshot.string();
}

}  // namespace lvx::runtime
