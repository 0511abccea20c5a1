// Decoder thread → bounded queue → preprocessing into the output batch (see pipeline.h).
#include "video/pipeline.h"

#include <unistd.h>

#include <algorithm>
#include <exception>
#include <iomanip>
#include <mutex>
#include <sstream>
#include <thread>

#include "src/common/error.h"
#include "video/bounded_queue.h"
#include "video/preprocess.h"
#include "video/sampler.h"

namespace lvx::video {
namespace {

struct QueueItem {
  int64_t ordinal = 0;  // position in the list of distinct targets
  DecodedFrame frame;
  bool ok = false;
  std::string why;           // when !ok
  std::exception_ptr error;  // the producer failed: rethrown by the consumer
};

std::string describe(const FrameIndex& index, int64_t i) {
  std::ostringstream os;
  os << "frame " << i << " (time " << std::fixed << std::setprecision(3) << index.time_seconds(i)
     << " s, pts " << index.pts_seconds(i) << " s)";
  return os.str();
}

}  // namespace

namespace {

// The sampled positions `positions` of the video, or `shard`'s when it is given (the sampled
// count is known only once the video is indexed).
FrameBatch decode_share(const std::string& path, const SampleSpec& spec,
                        const std::vector<int64_t>& positions, const PreprocessConfig& preprocess,
                        const DecodeOptions& options, const ShardSpec* shard);

}  // namespace

FrameBatch decode_video(const std::string& path, const SampleSpec& spec, const ShardSpec& shard,
                        const PreprocessConfig& preprocess, const DecodeOptions& options) {
  return decode_share(path, spec, std::vector<int64_t>{}, preprocess, options, &shard);
}

FrameBatch decode_positions(const std::string& path, const SampleSpec& spec,
                            const std::vector<int64_t>& positions,
                            const PreprocessConfig& preprocess, const DecodeOptions& options) {
  return decode_share(path, spec, positions, preprocess, options, nullptr);
}

namespace {

void check_options(const PreprocessConfig& preprocess, const DecodeOptions& options) {
  LVX_CHECK(options.queue_capacity >= 1 && options.queue_capacity <= kMaxQueueCapacity,
            "decode queue capacity must be in [1, ", kMaxQueueCapacity, "], got ",
            options.queue_capacity);
  LVX_CHECK(options.preprocess_threads >= 1 && options.preprocess_threads <= kMaxDecodeThreads,
            "preprocess threads must be in [1, ", kMaxDecodeThreads, "], got ",
            options.preprocess_threads);
  LVX_CHECK(preprocess.image_size <= kMaxImageSize, "preprocessing size ", preprocess.image_size,
            " is larger than ", kMaxImageSize, " pixels a side");
}

// The frames this call decodes: the sampled positions of its share (report.shard, checked), as
// frame indices in ascending order.
std::vector<int64_t> wanted_frames(const std::string& path, const FrameIndex& index,
                                   const SampleSpec& spec, const std::vector<int64_t>& positions,
                                   const DecodeOptions& options, const ShardSpec* shard,
                                   DecodeReport& report) {
  if (index.truncated) {
    LVX_CHECK(options.on_corrupt != CorruptPolicy::kError, "video '", path,
              "': truncated or damaged container: ", index.truncation_reason,
              " (use --on-corrupt skip|repeat to sample the readable part)");
    report.truncated = true;
    report.events.push_back("container truncated: " + index.truncation_reason +
                            "; sampling the readable part");
  }
  const Timeline timeline = index.timeline();
  if (spec.end && *spec.end > timeline.end + kTimeEpsilon)
    report.events.push_back(str("end ", *spec.end, " s is past the end of the video (",
                                timeline.end, " s): sampling up to the end"));
  const SampledFrames sampled = sample_frames(timeline, spec);
  report.sampled_total = static_cast<int64_t>(sampled.indices.size());
  report.shard = shard ? shard_positions(report.sampled_total, *shard) : positions;
  for (size_t i = 0; i < report.shard.size(); ++i)
    LVX_CHECK(report.shard[i] >= 0 && report.shard[i] < report.sampled_total &&
                  (i == 0 || report.shard[i] > report.shard[i - 1]),
              "video '", path, "': positions must be ascending in [0, ", report.sampled_total,
              "), got ", report.shard[i], " at ", i);
  std::vector<int64_t> wanted;  // ascending, as the sampled indices are
  for (int64_t p : report.shard) wanted.push_back(sampled.indices[static_cast<size_t>(p)]);
  return wanted;
}

// Where each decoded frame goes: the distinct targets (each decoded once) and, since `wanted` is
// sorted, target u's output positions [span[u], span[u + 1]).
struct Slots {
  std::vector<int64_t> targets, span;
  std::vector<uint8_t> done;        // target u preprocessed into its slots
  std::vector<std::string> failed;  // why target u could not be decoded
};

Slots slots_of(const std::vector<int64_t>& wanted) {
  Slots s;
  const auto n = static_cast<int64_t>(wanted.size());
  s.targets = wanted;
  s.targets.erase(std::unique(s.targets.begin(), s.targets.end()), s.targets.end());
  s.span.assign(s.targets.size() + 1, n);
  for (int64_t p = 0, u = 0; u < static_cast<int64_t>(s.targets.size()); ++u) {
    s.span[u] = p;
    while (p < n && wanted[p] == s.targets[u]) ++p;
  }
  s.done.assign(s.targets.size(), 0);
  s.failed.assign(s.targets.size(), "");
  return s;
}

// The output tensor, allocated at once: what this machine cannot hold (a huge --size) is refused.
at::Tensor allocate_frames(const std::string& path, int64_t n, int64_t out_h, int64_t out_w,
                           bool normalize) {
  const double out_bytes = static_cast<double>(n) * 3.0 * static_cast<double>(out_h) *
                           static_cast<double>(out_w) * (normalize ? 4.0 : 1.0);
  const double ram =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  LVX_CHECK(ram <= 0 || out_bytes <= ram / 2, "video '", path, "': ", n, " frames of 3 x ", out_h,
            " x ", out_w, " need ", out_bytes / (1 << 20),
            " MiB, more than half of this machine's ", ram / (1 << 20),
            " MiB: sample fewer frames or a smaller size");
  return at::empty({n, 3, out_h, out_w}, normalize ? at::kFloat : at::kByte);
}

// The decoder thread feeds a bounded queue; consumers (this thread and preprocess_threads − 1
// helpers) preprocess frames in whatever order they take them: each target owns its slots, so
// they never write the same memory. Policies that look at neighbours run afterwards.
void decode_into(VideoDecoder& decoder, const std::string& path, const PreprocessConfig& preprocess,
                 const DecodeOptions& options, Slots& slots, at::Tensor& frames) {
  const FrameIndex& index = decoder.index();
  BoundedQueue<QueueItem> queue(static_cast<size_t>(options.queue_capacity));
  std::thread producer([&] {
    try {
      for (size_t u = 0; u < slots.targets.size(); ++u) {
        QueueItem item;
        item.ordinal = static_cast<int64_t>(u);
        item.ok = decoder.decode_frame(slots.targets[u], &item.frame, &item.why);
        if (!queue.push(std::move(item))) return;  // the consumers gave up
      }
    } catch (...) {
      QueueItem item;
      item.error = std::current_exception();
      queue.push(std::move(item));
    }
    queue.close();
  });
  std::mutex error_mu;
  std::exception_ptr error;
  auto consume = [&] {
    try {
      while (auto item = queue.pop()) {
        if (item->error) std::rethrow_exception(item->error);
        const int64_t u = item->ordinal;
        if (!item->ok) {
          slots.failed[u] = item->why;
          LVX_CHECK(options.on_corrupt != CorruptPolicy::kError, "video '", path,
                    "': ", describe(index, slots.targets[u]), ": ", item->why,
                    " (use --on-corrupt skip|repeat to continue past damaged frames)");
          continue;
        }
        preprocess_frame(item->frame.rgb, preprocess, frames[slots.span[u]]);
        for (int64_t p = slots.span[u] + 1; p < slots.span[u + 1]; ++p)
          frames[p].copy_(frames[slots.span[u]]);
        slots.done[u] = 1;
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = std::current_exception();
      queue.cancel();
    }
  };
  std::vector<std::thread> helpers;
  for (int k = 1; k < options.preprocess_threads; ++k) helpers.emplace_back(consume);
  consume();
  for (auto& t : helpers) t.join();
  producer.join();
  if (error) std::rethrow_exception(error);
}

// Damaged frames, in order: skip drops them; repeat copies the previous good sampled frame (the
// next good one when none precedes). Returns which output positions stay.
std::vector<uint8_t> apply_corrupt_policy(const std::string& path, const FrameIndex& index,
                                          const DecodeOptions& options, const Slots& slots,
                                          int64_t n, at::Tensor& frames, DecodeReport& report) {
  std::vector<uint8_t> keep(n, 1);
  int64_t last_good = -1;
  std::vector<int64_t> owed;
  for (int64_t u = 0; u < static_cast<int64_t>(slots.targets.size()); ++u) {
    if (slots.done[u]) {
      for (int64_t p : owed) frames[p].copy_(frames[slots.span[u]]);
      owed.clear();
      last_good = slots.span[u];
      continue;
    }
    LVX_CHECK(!slots.failed[u].empty(), "video '", path,
              "': internal error: ", describe(index, slots.targets[u]),
              " was neither decoded nor reported");
    for (int64_t p = slots.span[u]; p < slots.span[u + 1]; ++p) {
      if (options.on_corrupt == CorruptPolicy::kSkip) {
        keep[p] = 0;
        ++report.skipped;
      } else {
        ++report.repeated;
        if (last_good >= 0)
          frames[p].copy_(frames[last_good]);
        else
          owed.push_back(p);
      }
    }
    report.events.push_back(describe(index, slots.targets[u]) + ": " + slots.failed[u] +
                            (options.on_corrupt == CorruptPolicy::kSkip
                                 ? "; skipped"
                                 : "; replaced by the nearest good sampled frame"));
  }
  LVX_CHECK(owed.empty(), "video '", path, "': none of the sampled frames could be decoded");
  return keep;
}

// Each output frame's index and times: repeated frames report the index and pts of the frame
// that was asked for (the pixels are the neighbour's); skipped frames are removed.
void label_frames(const FrameIndex& index, std::vector<int64_t> wanted,
                  const std::vector<uint8_t>& keep, FrameBatch& batch) {
  const auto n = static_cast<int64_t>(wanted.size());
  std::vector<double> out_pts(n), out_stream_pts(n);
  for (int64_t p = 0; p < n; ++p) {
    out_pts[p] = index.time_seconds(wanted[p]);
    out_stream_pts[p] = index.pts_seconds(wanted[p]);
  }
  batch.indices = at::from_blob(wanted.data(), {n}, at::kLong).clone();
  batch.pts = at::from_blob(out_pts.data(), {n}, at::kDouble).clone();
  batch.stream_pts = at::from_blob(out_stream_pts.data(), {n}, at::kDouble).clone();
  if (batch.report.skipped == 0) return;
  std::vector<int64_t> kept;
  for (int64_t p = 0; p < n; ++p)
    if (keep[p]) kept.push_back(p);
  const at::Tensor sel =
      at::from_blob(kept.data(), {static_cast<int64_t>(kept.size())}, at::kLong).clone();
  batch.frames = batch.frames.index_select(0, sel);
  batch.indices = batch.indices.index_select(0, sel);
  batch.pts = batch.pts.index_select(0, sel);
  batch.stream_pts = batch.stream_pts.index_select(0, sel);
}

FrameBatch decode_share(const std::string& path, const SampleSpec& spec,
                        const std::vector<int64_t>& positions, const PreprocessConfig& preprocess,
                        const DecodeOptions& options, const ShardSpec* shard) {
  check_options(preprocess, options);
  VideoDecoder decoder(path, options);
  const FrameIndex& index = decoder.index();
  FrameBatch batch;
  batch.info = decoder.info();
  const std::vector<int64_t> wanted =
      wanted_frames(path, index, spec, positions, options, shard, batch.report);
  const auto n = static_cast<int64_t>(wanted.size());
  Slots slots = slots_of(wanted);
  const auto [out_h, out_w] = preprocessed_size(preprocess, batch.info.height, batch.info.width);
  batch.frames = allocate_frames(path, n, out_h, out_w, preprocess.normalize);
  decode_into(decoder, path, preprocess, options, slots, batch.frames);
  const std::vector<uint8_t> keep =
      apply_corrupt_policy(path, index, options, slots, n, batch.frames, batch.report);
  label_frames(index, wanted, keep, batch);
  batch.report.stats = decoder.stats();
  return batch;
}

}  // namespace

}  // namespace lvx::video
