#include "src/runtime/train_checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "src/common/error.h"
#include "src/common/safetensors.h"

namespace lvx::runtime {

namespace fs = std::filesystem;

namespace {

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  LVX_CHECK(fd >= 0, p.string(), ": cannot open to flush it to disk");
  const int rc = ::fsync(fd);
  ::close(fd);
  LVX_CHECK(rc == 0, p.string(), ": fsync failed");
}

void write_text(const fs::path& p, const std::string& text) {
  {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f << text;
    LVX_CHECK(f.good(), p.string(), ": cannot write");
  }
  fsync_path(p);
}

// LVX_FAULT_CHECKPOINT=<point>[@step]: dies here, as kill -9 would, so tests can check that an
// interrupted write never costs the last good checkpoint.
void fault_point(const char* point, int64_t step) {
  const char* env = std::getenv("LVX_FAULT_CHECKPOINT");
  if (!env) return;
  std::string spec = env;
  const size_t at = spec.find('@');
  if (at != std::string::npos) {
    if (std::atoll(spec.c_str() + at + 1) != step) return;
    spec = spec.substr(0, at);
  }
  if (spec == point) {
    std::fprintf(stderr, "LVX_FAULT_CHECKPOINT=%s: exiting during the checkpoint of step %lld\n",
                 env, static_cast<long long>(step));
    std::fflush(stderr);
    ::_exit(137);
  }
}

bool is_weights_file(const std::string& name) {
  return name.size() > 12 &&
         (name.rfind(".safetensors") == name.size() - 12 || name == "model.safetensors.index.json");
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%06lld", static_cast<long long>(step));
  return buf;
}

std::string file_checksum(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  LVX_CHECK(f.good(), path, ": cannot open to checksum");
  uint64_t h = 1469598103934665603ULL;
  std::vector<char> buf(1 << 20);
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize n = f.gcount();
    for (std::streamsize i = 0; i < n; ++i) {
      h ^= static_cast<unsigned char>(buf[static_cast<size_t>(i)]);
      h *= 1099511628211ULL;
    }
  }
  char out[17];
  std::snprintf(out, sizeof(out), "%016llx", static_cast<unsigned long long>(h));
  return out;
}

std::map<std::string, std::string> read_model_files(const std::string& model_dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::directory_iterator(model_dir)) {
    const std::string n = e.path().filename().string();
    // Weights are written from the model; training state belongs to the checkpoint itself.
    if (!e.is_regular_file() || is_weights_file(n) || n == "manifest.json" ||
        n == "trainer_state.json" || n == "stamp")
      continue;
    std::ifstream f(e.path(), std::ios::binary);
    files[n] = std::string(std::istreambuf_iterator<char>(f), {});
  }
  return files;
}

std::string save_train_checkpoint(const std::string& root, int64_t step,
                                  const std::map<std::string, std::string>& model_files,
                                  const std::map<std::string, at::Tensor>& params,
                                  const std::map<std::string, at::Tensor>& optimizer,
                                  const nlohmann::json& state, int64_t keep) {
  fs::create_directories(root);
  const std::string name = checkpoint_name(step);
  const fs::path final_dir = fs::path(root) / name, tmp = fs::path(root) / (name + ".partial");
  // Leftovers of interrupted writes are never read; clear them so they cannot pile up.
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.size() > 8 && n.substr(n.size() - 8) == ".partial")
      fs::remove_all(e.path());
  }
  fs::create_directories(tmp);
  nlohmann::json files = nlohmann::json::object();
  auto done = [&](const std::string& file) {
    fsync_path(tmp / file);
    files[file] = {{"bytes", fs::file_size(tmp / file)},
                   {"fnv1a64", file_checksum((tmp / file).string())}};
    fault_point("after_first_file", step);
  };
  save_safetensors((tmp / "model.safetensors").string(), params, {{"format", "pt"}});
  done("model.safetensors");
  LVX_CHECK(model_files.count("config.json"), "checkpoint: the model's files have no config.json");
  for (const auto& [n, bytes] : model_files) {
    write_text(tmp / n, bytes);
    done(n);
  }
  save_safetensors((tmp / "optimizer.safetensors").string(), optimizer,
                   {{"step", std::to_string(step)}});
  done("optimizer.safetensors");
  write_text(tmp / "trainer_state.json", state.dump(2));
  done("trainer_state.json");
  write_text(tmp / "manifest.json", nlohmann::json{{"step", step}, {"files", files}}.dump(2));
  fsync_path(tmp);
  if (fs::exists(final_dir)) fs::remove_all(final_dir);  // a rerun of this step replaces it
  fs::rename(tmp, final_dir);
  fsync_path(root);
  fault_point("before_latest", step);
  write_text(fs::path(root) / "latest.tmp", name + "\n");
  fs::rename(fs::path(root) / "latest.tmp", fs::path(root) / "latest");
  fsync_path(root);
  // Only now that `latest` names the new checkpoint may old ones go.
  std::vector<std::string> steps;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("step-", 0) == 0 && n.find('.') == std::string::npos)
      steps.push_back(n);
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i)
    if (steps[i] != name) fs::remove_all(fs::path(root) / steps[i]);
  return final_dir.string();
}

std::string latest_checkpoint(const std::string& root) {
  const fs::path p = fs::path(root) / "latest";
  if (!fs::exists(p)) return "";
  std::ifstream f(p);
  std::string name;
  std::getline(f, name);
  LVX_CHECK(!name.empty() && name.find('/') == std::string::npos, p.string(),
            ": expected the name of a checkpoint folder, got '", name, "'");
  const fs::path dir = fs::path(root) / name;
  LVX_CHECK(fs::is_directory(dir), p.string(), ": names ", name, ", which does not exist");
  return dir.string();
}

void verify_checkpoint(const std::string& dir) {
  const fs::path m = fs::path(dir) / "manifest.json";
  LVX_CHECK(fs::exists(m), dir, ": has no manifest.json (an incomplete or foreign checkpoint)");
  nlohmann::json j;
  try {
    std::ifstream f(m);
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    LVX_FAIL(m.string(), ": corrupt (not valid JSON: ", e.what(), ")");
  }
  LVX_CHECK(j.contains("files") && j["files"].is_object(), m.string(), ": corrupt (no 'files')");
  for (const auto& [file, info] : j["files"].items()) {
    const fs::path p = fs::path(dir) / file;
    LVX_CHECK(fs::exists(p), dir, ": corrupt checkpoint: ", file, " is missing");
    LVX_CHECK(fs::file_size(p) == info.value("bytes", uint64_t{0}), dir,
              ": corrupt checkpoint: ", file, " has ", fs::file_size(p),
              " bytes, the manifest says ", info.value("bytes", uint64_t{0}));
    const std::string sum = file_checksum(p.string());
    LVX_CHECK(sum == info.value("fnv1a64", std::string()), dir, ": corrupt checkpoint: ", file,
              " has checksum ", sum, ", the manifest says ", info.value("fnv1a64", std::string()));
  }
}

}  // namespace lvx::runtime
