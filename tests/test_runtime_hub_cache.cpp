// Hugging Face names resolved offline in a cache laid out as huggingface_hub writes it
// (src/runtime/hub_cache.h): refs/<revision> holding a commit, snapshots/<commit>/ whose files are
// symlinks into blobs/. A folder of the same relative name wins; a name or revision not cached
// gets an error naming where lvx looked and the download command.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "src/common/error.h"
#include "src/runtime/hub_cache.h"
#include "src/runtime/train_checkpoint.h"
#include "src/runtime/train_config.h"

namespace fs = std::filesystem;

namespace {

// One cached model: main → commit aaa, v1 → commit bbb, each snapshot's config.json a symlink to
// its blob.
fs::path make_cache() {
  const fs::path cache = fs::temp_directory_path() / ("lvx-hub-" + std::to_string(::getpid()));
  fs::remove_all(cache);
  const fs::path repo = cache / "models--mPLUG--mPLUG-Owl3-7B-240728";
  for (const auto& [ref, commit] : {std::pair{"main", "aaa111"}, std::pair{"v1", "bbb222"}}) {
    fs::create_directories(repo / "refs");
    std::ofstream(repo / "refs" / ref) << commit;  // as the hub writes it: no newline
    fs::create_directories(repo / "blobs");
    std::ofstream(repo / "blobs" / (std::string("blob-") + commit))
        << "{\"commit\": \"" << commit << "\"}";
    fs::create_directories(repo / "snapshots" / commit);
    fs::create_symlink(fs::path("../../blobs") / (std::string("blob-") + commit),
                       repo / "snapshots" / commit / "config.json");
  }
  return cache;
}

std::string error_of(const std::string& name) {
  try {
    lvx::runtime::follow_run_folder(name);
  } catch (const lvx::Error& e) {
    return e.what();
  }
  return "";
}

TEST(HubCache, NamesResolveToTheirCachedSnapshot) {
  const fs::path cache = make_cache();
  ::setenv("HF_HUB_CACHE", cache.c_str(), 1);
  const fs::path repo = cache / "models--mPLUG--mPLUG-Owl3-7B-240728";
  EXPECT_EQ(lvx::runtime::follow_run_folder("mPLUG/mPLUG-Owl3-7B-240728"),
            (repo / "snapshots" / "aaa111").string());
  EXPECT_EQ(lvx::runtime::follow_run_folder("mPLUG/mPLUG-Owl3-7B-240728@v1"),
            (repo / "snapshots" / "bbb222").string());
  EXPECT_EQ(lvx::runtime::follow_run_folder("mPLUG/mPLUG-Owl3-7B-240728@bbb222"),
            (repo / "snapshots" / "bbb222").string());  // a commit names its snapshot
  std::ifstream config(repo / "snapshots" / "aaa111" / "config.json");  // through the symlink
  std::string text;
  std::getline(config, text);
  EXPECT_EQ(text, "{\"commit\": \"aaa111\"}");
  // HF_HOME/hub when HF_HUB_CACHE is unset.
  ::unsetenv("HF_HUB_CACHE");
  ::setenv("HF_HOME", "/somewhere", 1);
  EXPECT_EQ(lvx::runtime::hub_cache_dir(), "/somewhere/hub");
  ::unsetenv("HF_HOME");
  ::setenv("HF_HUB_CACHE", cache.c_str(), 1);
  // Not cached: where lvx looked and how to get it.
  const std::string missing = error_of("org/not-there");
  EXPECT_NE(missing.find((cache / "models--org--not-there").string()), std::string::npos)
      << missing;
  EXPECT_NE(missing.find("huggingface-cli download org/not-there"), std::string::npos) << missing;
  const std::string rev = error_of("mPLUG/mPLUG-Owl3-7B-240728@v9");
  EXPECT_NE(rev.find("revision 'v9'"), std::string::npos) << rev;
  EXPECT_NE(rev.find("--revision v9"), std::string::npos) << rev;
  // Paths are never hub names; an existing folder of that relative name wins.
  EXPECT_FALSE(lvx::runtime::is_hub_name("./org/name"));
  EXPECT_FALSE(lvx::runtime::is_hub_name("/abs/path"));
  EXPECT_FALSE(lvx::runtime::is_hub_name("configs/models/tiny.yaml"));
  EXPECT_TRUE(lvx::runtime::is_hub_name("Qwen/Qwen2-0.5B@main"));
  const fs::path here = fs::temp_directory_path();
  fs::current_path(here);
  fs::create_directories(here / "org-local" / "model");
  EXPECT_EQ(lvx::runtime::follow_run_folder("org-local/model"), "org-local/model");
  fs::remove_all(here / "org-local");
  ::unsetenv("HF_HUB_CACHE");
  fs::remove_all(cache);
}

}  // namespace

// lvx finetune's model.path takes the same names (users write the name they pass to
// from_pretrained); the resolved snapshot is what the run records.
TEST(HubCache, FinetuneModelPathTakesAName) {
  const fs::path cache = make_cache();
  ::setenv("HF_HUB_CACHE", cache.c_str(), 1);
  const fs::path yaml = cache / "run.yaml";
  std::ofstream(yaml) << "model: {path: mPLUG/mPLUG-Owl3-7B-240728@v1}\n"
                      << "data: {train: t.jsonl, num_frames: 4}\n"
                      << "schedule: {steps: 1}\ncheckpoint: {dir: ck}\n";
  const lvx::runtime::TrainConfig c = lvx::runtime::load_train_config(yaml.string(), {});
  EXPECT_EQ(c.model.path,
            (cache / "models--mPLUG--mPLUG-Owl3-7B-240728" / "snapshots" / "bbb222").string());
  std::ofstream(yaml) << "model: {path: mPLUG/not-cached}\n"
                      << "data: {train: t.jsonl, num_frames: 4}\n"
                      << "schedule: {steps: 1}\ncheckpoint: {dir: ck}\n";
  std::string error;
  try {
    lvx::runtime::load_train_config(yaml.string(), {});
  } catch (const lvx::Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("huggingface-cli download mPLUG/not-cached"), std::string::npos) << error;
  ::unsetenv("HF_HUB_CACHE");
  fs::remove_all(cache);
}
