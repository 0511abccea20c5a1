#include "src/runtime/train_checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>
#include <vector>

#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
#include "src/runtime/hub_cache.h"
#include "src/runtime/train_faults.h"

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

// A test's fault hook at `point` of the checkpoint of `step` (train_faults.h); none in lvx.
void fault_point(const char* point, int64_t step) {
  if (TrainFaults* f = train_faults()) f->in_checkpoint(point, step);
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

std::map<std::string, std::string> read_model_files(const std::string& model_dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::directory_iterator(model_dir)) {
    const std::string n = e.path().filename().string();
    // Weights are written from the model; training state belongs to the checkpoint itself.
    if (!e.is_regular_file() || is_weights_file(n) || n == "manifest.json" ||
        n == "trainer_state.json" || n == "stamp")
      continue;
    files[n] = read_file(e.path().string(), "model file");
  }
  return files;
}

std::string begin_train_checkpoint(const std::string& root, int64_t step) {
  fs::create_directories(root);
  const std::string name = checkpoint_name(step);
  const fs::path tmp = fs::path(root) / (name + ".partial");
  // Leftovers of interrupted writes are never read; clear them so they cannot pile up.
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.size() > 8 && n.substr(n.size() - 8) == ".partial")
      fs::remove_all(e.path());
  }
  fs::create_directories(tmp);
  return tmp.string();
}

std::string save_train_checkpoint(const std::string& root, int64_t step,
                                  const std::map<std::string, std::string>& model_files,
                                  const std::map<std::string, at::Tensor>& params,
                                  const std::map<std::string, at::Tensor>& optimizer,
                                  const nlohmann::json& state, int64_t keep,
                                  const std::vector<std::string>& present,
                                  const std::string& weights_file) {
  const std::string name = checkpoint_name(step);
  const fs::path final_dir = fs::path(root) / name, tmp = fs::path(root) / (name + ".partial");
  if (present.empty()) begin_train_checkpoint(root, step);
  LVX_CHECK(fs::is_directory(tmp), tmp.string(), ": the checkpoint being written is gone");
  fault_point("slow", step);
  nlohmann::json files = nlohmann::json::object();
  auto done = [&](const std::string& file) {
    fsync_path(tmp / file);
    files[file] = {{"bytes", fs::file_size(tmp / file)},
                   {"xxh3", file_xxh3((tmp / file).string())}};
    fault_point("after_first_file", step);
  };
  for (const std::string& f : present) {
    LVX_CHECK(fs::is_regular_file(tmp / f), tmp.string(), ": ", f, " was not written");
    done(f);
  }
  save_safetensors((tmp / weights_file).string(), params, {{"format", "pt"}});
  done(weights_file);
  LVX_CHECK(weights_file != "model.safetensors" || model_files.count("config.json"),
            "checkpoint: the model's files have no config.json");
  for (const auto& [n, bytes] : model_files) {
    write_text(tmp / n, bytes);
    done(n);
  }
  if (!optimizer.empty()) {
    save_safetensors((tmp / "optimizer.safetensors").string(), optimizer,
                     {{"step", std::to_string(step)}});
    done("optimizer.safetensors");
  }
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
  // Only now that `latest` names the new checkpoint may old ones go; the best one stays.
  const std::vector<std::string> steps = checkpoint_folders(root);
  const std::optional<BestCheckpoint> best = read_best_checkpoint(root);
  for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i)
    if (steps[i] != name && !(best && steps[i] == best->checkpoint))
      fs::remove_all(fs::path(root) / steps[i]);
  return final_dir.string();
}

std::vector<std::string> checkpoint_folders(const std::string& root) {
  std::vector<std::string> steps;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return steps;
  for (const auto& e : fs::directory_iterator(root)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("step-", 0) == 0 && n.find('.') == std::string::npos)
      steps.push_back(n);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::string latest_checkpoint(const std::string& root) {
  const fs::path p = fs::path(root) / "latest";
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(p, ec))) {
    // Step folders without the pointer: the pointer was deleted (or lost) after checkpoints were
    // written. Starting fresh would remove them (keep), resuming from a guess could pick a
    // checkpoint the user did not mean: refuse and say how to choose.
    const std::vector<std::string> steps = checkpoint_folders(root);
    if (!steps.empty()) {
      std::string list;
      for (const auto& s : steps) list += (list.empty() ? "" : ", ") + s;
      LVX_FAIL("checkpoint.dir: ", root, " holds checkpoint folders (", list, ") but no 'latest' ",
               "pointer naming the one to continue from; write the chosen name into ", p.string(),
               " (e.g. echo ", steps.back(), " > ", p.string(), ") and pass --resume, or ",
               "choose another checkpoint.dir (nothing was changed)");
    }
    return "";
  }
  std::string name = read_file(p.string(), "checkpoint pointer", 4096);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' '))
    name.pop_back();
  LVX_CHECK(!name.empty() && name.find('/') == std::string::npos &&
                name.find('\n') == std::string::npos && name != "." && name != "..",
            p.string(), ": expected the name of a checkpoint folder, got '", name, "'");
  const fs::path dir = fs::path(root) / name;
  LVX_CHECK(fs::is_directory(dir), p.string(), ": names ", name, ", which does not exist");
  return dir.string();
}

std::optional<BestCheckpoint> read_best_checkpoint(const std::string& root) {
  const fs::path p = fs::path(root) / "best.json";
  std::error_code ec;
  if (!fs::exists(p, ec)) return std::nullopt;
  const nlohmann::json j = read_json_file(p.string(), "best checkpoint", 4096);
  BestCheckpoint b;
  try {
    b.checkpoint = j.at("checkpoint").get<std::string>();
    b.step = j.at("step").get<int64_t>();
    b.metric = j.at("metric").get<std::string>();
    b.value = j.at("value").get<double>();
  } catch (const nlohmann::json::exception&) {
    LVX_FAIL(p.string(), ": expected {checkpoint, step, metric, value}");
  }
  LVX_CHECK(!b.checkpoint.empty() && b.checkpoint.find('/') == std::string::npos, p.string(),
            ": 'checkpoint' must name a folder of ", root);
  return b;
}

void write_best_checkpoint(const std::string& root, const BestCheckpoint& best) {
  const nlohmann::json j = {{"checkpoint", best.checkpoint},
                            {"step", best.step},
                            {"metric", best.metric},
                            {"value", best.value}};
  write_text(fs::path(root) / "best.json.tmp", j.dump(2) + "\n");
  fs::rename(fs::path(root) / "best.json.tmp", fs::path(root) / "best.json");
  fsync_path(root);
}

std::string follow_run_folder(const std::string& name) {
  std::error_code ec;
  // A Hugging Face name (org/name[@revision]) that is not a folder here: its cached snapshot.
  const std::string path =
      !fs::exists(name, ec) && is_hub_name(name) ? hub_snapshot(name) : name;
  const fs::path p(path);
  if (!fs::is_directory(p, ec) || fs::exists(p / "config.json", ec) ||
      fs::exists(p / "adapter_config.json", ec) ||
      !fs::exists(fs::symlink_status(p / "latest", ec)))
    return path;
  const std::string dir = latest_checkpoint(path);
  LVX_CHECK(!dir.empty(), path, ": a run folder whose 'latest' names no checkpoint");
  std::cerr << "lvx: " << path << " is a run folder: using its latest checkpoint " << dir << "\n";
  return dir;
}

void verify_checkpoint(const std::string& dir) {
  LVX_CHECK(verify_manifest(dir), dir,
            ": has no manifest.json (an incomplete or foreign checkpoint)");
}

}  // namespace lvx::runtime
