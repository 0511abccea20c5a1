// Hugging Face model names (`--model org/name[@revision]`), resolved offline in the local hub
// cache as transformers and vLLM resolve them with HF_HUB_OFFLINE=1: the cache folder is
// $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; the model's files are
// models--org--name/snapshots/<commit>/, the commit read from refs/<revision> (default main) or
// given as the revision itself. lvx never downloads.
#pragma once

#include <optional>
#include <string>

namespace lvx::runtime {

// Whether `name` reads as a hub name (org/name or org/name@revision: letters, digits, '.', '_',
// '-'; not a path that starts with '.', '/' or '~').
bool is_hub_name(const std::string& name);

// The hub cache folder this process would read.
std::string hub_cache_dir();

// The snapshot folder of hub name `name` in the cache; an error naming where lvx looked and how
// to download it when the model (or its revision) is not there.
std::string hub_snapshot(const std::string& name);

}  // namespace lvx::runtime
