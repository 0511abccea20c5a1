// What rank 0 of lvx serve sends every rank for each command (src/serve/server.h): an opcode, a
// JSON description and the byte strings it refers to (media sent inline in the request), in
// one broadcast of their length and one of their bytes. Every rank calls these in the same order.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/dist/process_group.h"

namespace lvx::serve {

// kAnswer begins a generation (its description and media: QaSession::begin); kAdvance starts it
// once its frames (and, for a prompt prefilled in chunks, its media) are ready on rank 0
// (QaSession::advance); kChunk runs the next chunk of its prompt (QaSession::prefill_next); both
// name it by its id ({"id": ...}). kStep gives every generation that runs its next token (no
// payload: every rank holds the same batch in the same order).
enum class Op : int64_t {
  kHeartbeat = 1,
  kAnswer = 2,
  kShutdown = 3,
  kStep = 4,
  kAdvance = 5,
  kChunk = 6
};

struct Command {
  Op op = Op::kHeartbeat;
  nlohmann::json desc;
  std::vector<std::string> blobs;
};

// Rank 0: sends `c`. Other ranks: receive it into `c`. A heartbeat ends with a barrier (every
// rank answered: a dead rank is found while the server idles).
void exchange(dist::ProcessGroup& pg, Command& c);

// The bytes of a command and back (exposed for tests).
std::string pack(const Command& c);
Command unpack(const std::string& bytes);

}  // namespace lvx::serve
