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

FrameBatch decode_share(const std::string& path, const SampleSpec& spec,
                        const std::vector<int64_t>& positions, const PreprocessConfig& preprocess,
                        const DecodeOptions& options, const ShardSpec* shard) {
  LVX_CHECK(options.queue_capacity >= 1 && options.queue_capacity <= kMaxQueueCapacity,
            "decode queue capacity must be in [1, ", kMaxQueueCapacity, "], got ",
            options.queue_capacity);
  LVX_CHECK(options.preprocess_threads >= 1 && options.preprocess_threads <= kMaxDecodeThreads,
            "preprocess threads must be in [1, ", kMaxDecodeThreads, "], got ",
            options.preprocess_threads);
  LVX_CHECK(preprocess.image_size <= kMaxImageSize, "preprocessing size ", preprocess.image_size,
            " is larger than ", kMaxImageSize, " pixels a side");
  VideoDecoder decoder(path, options);
  const FrameIndex& index = decoder.index();
  FrameBatch batch;
  batch.info = decoder.info();
  DecodeReport& report = batch.report;
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
  const int64_t n = static_cast<int64_t>(wanted.size());
  std::vector<int64_t> targets = wanted;  // sorted already; decode each distinct frame once
  targets.erase(std::unique(targets.begin(), targets.end()), targets.end());

  const auto [out_h, out_w] = preprocessed_size(preprocess, batch.info.height, batch.info.width);
  // The output is allocated at once: refuse what this machine cannot hold (a huge --size).
  const double out_bytes = static_cast<double>(n) * 3.0 * static_cast<double>(out_h) *
                           static_cast<double>(out_w) * (preprocess.normalize ? 4.0 : 1.0);
  const double ram =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  LVX_CHECK(ram <= 0 || out_bytes <= ram / 2, "video '", path, "': ", n, " frames of 3 x ", out_h,
            " x ", out_w, " need ", out_bytes / (1 << 20),
            " MiB, more than half of this machine's ", ram / (1 << 20),
            " MiB: sample fewer frames or a smaller size");
  batch.frames = at::empty({n, 3, out_h, out_w}, preprocess.normalize ? at::kFloat : at::kByte);
  // wanted is sorted, so distinct target u fills output positions [span[u], span[u + 1]).
  std::vector<int64_t> span(targets.size() + 1, n);
  for (int64_t p = 0, u = 0; u < static_cast<int64_t>(targets.size()); ++u) {
    span[u] = p;
    while (p < n && wanted[p] == targets[u]) ++p;
  }
  std::vector<int64_t> out_index(wanted);
  std::vector<double> out_pts(n), out_stream_pts(n);
  for (int64_t p = 0; p < n; ++p) {
    out_pts[p] = index.time_seconds(wanted[p]);
    out_stream_pts[p] = index.pts_seconds(wanted[p]);
  }
  std::vector<uint8_t> done(targets.size(), 0);     // target u preprocessed into its slots
  std::vector<std::string> failed(targets.size());  // why target u could not be decoded

  BoundedQueue<QueueItem> queue(static_cast<size_t>(options.queue_capacity));
  std::thread producer([&] {
    try {
      for (size_t u = 0; u < targets.size(); ++u) {
        QueueItem item;
        item.ordinal = static_cast<int64_t>(u);
        item.ok = decoder.decode_frame(targets[u], &item.frame, &item.why);
        if (!queue.push(std::move(item))) return;  // the consumers gave up
      }
    } catch (...) {
      QueueItem item;
      item.error = std::current_exception();
      queue.push(std::move(item));
    }
    queue.close();
  });

  // Consumers preprocess frames in whatever order they take them: each target owns its slots,
  // so they never write the same memory. Policies that look at neighbours run afterwards.
  std::mutex error_mu;
  std::exception_ptr error;
  auto consume = [&] {
    try {
      while (auto item = queue.pop()) {
        if (item->error) std::rethrow_exception(item->error);
        const int64_t u = item->ordinal;
        if (!item->ok) {
          failed[u] = item->why;
          LVX_CHECK(options.on_corrupt != CorruptPolicy::kError, "video '", path,
                    "': ", describe(index, targets[u]), ": ", item->why,
                    " (use --on-corrupt skip|repeat to continue past damaged frames)");
          continue;
        }
        preprocess_frame(item->frame.rgb, preprocess, batch.frames[span[u]]);
        for (int64_t p = span[u] + 1; p < span[u + 1]; ++p)
          batch.frames[p].copy_(batch.frames[span[u]]);
        done[u] = 1;
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

  // Damaged frames, in order: skip drops them; repeat copies the previous good sampled frame
  // (the next good one when none precedes).
  std::vector<uint8_t> keep(n, 1);
  int64_t last_good = -1;
  std::vector<int64_t> owed;
  for (int64_t u = 0; u < static_cast<int64_t>(targets.size()); ++u) {
    if (done[u]) {
      for (int64_t p : owed) batch.frames[p].copy_(batch.frames[span[u]]);
      owed.clear();
      last_good = span[u];
      continue;
    }
    LVX_CHECK(!failed[u].empty(), "video '", path,
              "': internal error: ", describe(index, targets[u]),
              " was neither decoded nor reported");
    for (int64_t p = span[u]; p < span[u + 1]; ++p) {
      if (options.on_corrupt == CorruptPolicy::kSkip) {
        keep[p] = 0;
        ++report.skipped;
      } else {
        ++report.repeated;
        if (last_good >= 0)
          batch.frames[p].copy_(batch.frames[last_good]);
        else
          owed.push_back(p);
      }
    }
    report.events.push_back(describe(index, targets[u]) + ": " + failed[u] +
                            (options.on_corrupt == CorruptPolicy::kSkip
                                 ? "; skipped"
                                 : "; replaced by the nearest good sampled frame"));
  }
  LVX_CHECK(owed.empty(), "video '", path, "': none of the sampled frames could be decoded");
  // Repeated frames report the index and pts of the frame that was asked for; the pixels are
  // the neighbour's. Skipped frames are removed.
  batch.indices = at::from_blob(out_index.data(), {n}, at::kLong).clone();
  batch.pts = at::from_blob(out_pts.data(), {n}, at::kDouble).clone();
  batch.stream_pts = at::from_blob(out_stream_pts.data(), {n}, at::kDouble).clone();
  if (report.skipped > 0) {
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
  report.stats = decoder.stats();
  return batch;
}

}  // namespace

}  // namespace lvx::video
