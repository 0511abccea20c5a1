// TensorBoard event files written by lvx: `lvx finetune` with `logging.tensorboard: DIR` writes
// every step's numeric metrics as scalars `train/<field>` (the fields of metrics.jsonl), which
// `tensorboard --logdir DIR` shows without any conversion.
//
// The format TensorBoard reads (tensorboard/summary/writer/record_writer.py, event_file_writer.py;
// tensorflow/core/util/event.proto, summary.proto): a file named events.out.tfevents.<seconds>.
// <host>.lvx holding TFRecords, each
//   uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
// (little endian; masked = ((crc >> 15) | (crc << 17)) + 0xa282ead8, CRC-32C), whose data is one
// serialised Event: wall_time (field 1, double), step (2, int64), and either file_version (3,
// "brain.Event:2", the first record) or summary (5) = Summary { repeated Value value = 1 },
// Value { tag = 1 (string), simple_value = 2 (float) }. Written by hand (the protobuf wire format
// of three messages) rather than linking protobuf for them. Each record is flushed as written,
// so a killed run leaves whole records; a resumed run starts a new file (TensorBoard merges a
// folder's files by step).
#pragma once

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace lvx::runtime {

class TensorBoardWriter {
 public:
  // Creates `dir` and a new event file in it (an error names the path).
  explicit TensorBoardWriter(const std::string& dir);
  // One scalar at `step`.
  void scalar(const std::string& tag, int64_t step, double value);
  // Every number of a metrics line (but `step`) as `<prefix><field>` at its step.
  void metrics(const nlohmann::json& line, const std::string& prefix = "train/");
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::string path_;
  std::ofstream out_;
};

// CRC-32C (Castagnoli) of `n` bytes, and TFRecord's masking of it.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

}  // namespace lvx::runtime
