// Small option structs for the video pipeline: how to decode, what to sample, how to preprocess.
// Each field's unit and default is stated here; docs/video.md gives the rules they select.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace lvx::video {

// What to do with a sampled frame that cannot be decoded (decoder error, frame flagged corrupt,
// or missing after a truncation). Every action taken is reported in DecodeReport.
enum class CorruptPolicy {
  kError,   // throw lvx::Error naming the file and frame index (default)
  kSkip,    // drop the frame from the output (fewer than the requested frames come out)
  kRepeat,  // emit the previous good sampled frame (the next good one if none precedes it)
};
CorruptPolicy parse_corrupt_policy(const std::string& s);  // "error" | "skip" | "repeat"
const char* to_string(CorruptPolicy p);

// Bounds of the thread and queue counts below: far above any useful value, low enough that a
// typo (100000) is an error instead of a failed thread creation or a queue of huge frames.
constexpr int kMaxDecodeThreads = 256;
constexpr int kMaxQueueCapacity = 1024;

struct DecodeOptions {
  // libavcodec threads. 1 is best when many decoders run side by side (one per rank/worker);
  // 0 lets FFmpeg choose (one per core). Explicit on purpose: see torchcodec #1639, #715.
  int threads = 1;
  // Decoded frames waiting for the consumer (preprocessing). Bounds memory: at most this many
  // RGB frames exist between the decoder thread and the consumer, whatever the video length.
  int queue_capacity = 4;
  // Threads preprocessing decoded frames (resize, crop, normalize) in parallel with the decoder
  // thread. 1 suits one rank per few cores; raise it when a rank has cores to spare.
  int preprocess_threads = 1;
  CorruptPolicy on_corrupt = CorruptPolicy::kError;
  // Read and write the frame index through the index cache (index_cache.h), so that the packet
  // scan runs once per video, not once per rank and run. LVX_INDEX_CACHE=off also disables it.
  bool index_cache = true;
  // Largest frame (width x height) opened, checked from the stream's header before any frame is
  // decoded: 8192 x 8192 (an 8K UHD video is 7680 x 4320).
  int64_t max_frame_pixels = int64_t{8192} * 8192;
};

// Which frames to take. Exactly one of `fps` and `num_frames` is set. Times are seconds of player
// time: 0 is the first displayed frame, whatever the stream's own start pts (docs/video.md).
struct SampleSpec {
  std::optional<double> fps;          // timestamps start, start + 1/fps, ... (< end)
  std::optional<int64_t> num_frames;  // N frames spread over [start, end], both ends included
  std::optional<double> start;        // default: 0, the first frame
  std::optional<double> end;          // exclusive; default: the end of the last frame
  // At most this many sampled frames, whichever of fps and num_frames asks (lvx serve
  // --max-frames): more is refused from the timeline, before a frame is decoded. 0: no bound.
  int64_t max_frames = 0;
};

// At most this many sampled positions per frame of the range (fps above the source rate and N
// above the range's frame count repeat frames): more is refused before anything is allocated.
constexpr int64_t kMaxSamplesPerFrame = 64;
// Largest output side of preprocessing (PreprocessConfig::image_size).
constexpr int64_t kMaxImageSize = 8192;

// Rank r of `world` takes the sampled frames r, r + world, … (see sampler.h).
struct ShardSpec {
  int64_t rank = 0;
  int64_t world = 1;
};

// Image preprocessing as a vision tower's processor does it. Presets follow the model configs
// (docs/video.md; the releases' preprocessing).
enum class ResizeMode {
  kSquash,        // resize to size×size, aspect ratio not kept (mPLUG-Owl3 / SigLIP)
  kShortestEdge,  // shortest edge → size, then centre crop size×size (CLIP / open_clip)
  kPad,           // pad to a square with the mean colour (LLaVA expand2square), then resize
};
ResizeMode parse_resize_mode(const std::string& s);  // "squash" | "shortest-edge" | "pad"
const char* to_string(ResizeMode m);

struct PreprocessConfig {
  int64_t image_size = 384;  // output H = W (pixels)
  ResizeMode resize = ResizeMode::kSquash;
  std::array<float, 3> mean{0.5f, 0.5f, 0.5f};  // per RGB channel, on [0, 1] values
  std::array<float, 3> std{0.5f, 0.5f, 0.5f};
  bool normalize = false;  // false: uint8 [N,3,H,W]; true: float32 (x/255 - mean) / std

  // SigLIP as mPLUG-Owl3 uses it: Resize((384, 384), bicubic), mean = std = 0.5.
  static PreprocessConfig siglip();
  // CLIP ViT-L/14 as OpenFlamingo uses it: shortest edge 224 bicubic, centre crop, CLIP mean/std.
  static PreprocessConfig clip();
  static PreprocessConfig preset(const std::string& name);  // "siglip" | "clip"
};

}  // namespace lvx::video
