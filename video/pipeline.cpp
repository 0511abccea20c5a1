// Decoder thread → bounded queue → preprocessing into the output batch (see pipeline.h).
#include "video/pipeline.h"

#include <algorithm>
#include <exception>
#include <iomanip>
#include <sstream>
#include <thread>

#include "video/bounded_queue.h"
#include "video/preprocess.h"
#include "video/sampler.h"

namespace lvx::video {
namespace {

struct QueueItem {
  DecodedFrame frame;
  bool ok = false;
  std::string why;           // when !ok
  std::exception_ptr error;  // the producer failed: rethrown by the consumer
};

std::string describe(const FrameIndex& index, int64_t i) {
  std::ostringstream os;
  os << "frame " << i << " (pts " << std::fixed << std::setprecision(3) << index.pts_seconds(i)
     << " s)";
  return os.str();
}

}  // namespace

FrameBatch decode_video(const std::string& path, const SampleSpec& spec, const ShardSpec& shard,
                        const PreprocessConfig& preprocess, const DecodeOptions& options) {
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
  const SampledFrames sampled = sample_frames(index.timeline(), spec);
  report.sampled_total = static_cast<int64_t>(sampled.indices.size());
  std::tie(report.shard_begin, report.shard_end) = shard_range(report.sampled_total, shard);
  const std::vector<int64_t> wanted(sampled.indices.begin() + report.shard_begin,
                                    sampled.indices.begin() + report.shard_end);
  const int64_t n = static_cast<int64_t>(wanted.size());
  std::vector<int64_t> targets = wanted;  // sorted already; decode each distinct frame once
  targets.erase(std::unique(targets.begin(), targets.end()), targets.end());

  const auto [out_h, out_w] = preprocessed_size(preprocess, batch.info.height, batch.info.width);
  batch.frames = at::empty({n, 3, out_h, out_w}, preprocess.normalize ? at::kFloat : at::kByte);
  std::vector<int64_t> out_index(n, -1);
  std::vector<double> out_pts(n, 0);
  std::vector<uint8_t> keep(n, 1);

  BoundedQueue<QueueItem> queue(static_cast<size_t>(options.queue_capacity));
  std::thread producer([&] {
    try {
      for (int64_t t : targets) {
        QueueItem item;
        item.ok = decoder.decode_frame(t, &item.frame, &item.why);
        item.frame.index = t;
        if (!queue.push(std::move(item))) return;  // consumer gave up
      }
    } catch (...) {
      QueueItem item;
      item.error = std::current_exception();
      queue.push(std::move(item));
    }
    queue.close();
  });

  int64_t pos = 0;            // next output position
  int64_t last_good = -1;     // last output position holding a decoded frame
  std::vector<int64_t> owed;  // positions waiting for a frame to repeat (kRepeat, none yet)
  try {
    while (auto item = queue.pop()) {
      if (item->error) std::rethrow_exception(item->error);
      const int64_t t = item->frame.index;
      const int64_t first = pos;
      while (pos < n && wanted[pos] == t) ++pos;
      for (int64_t p = first; p < pos; ++p) {
        out_index[p] = t;
        out_pts[p] = index.pts_seconds(t);
      }
      if (item->ok) {
        preprocess_frame(item->frame.rgb, preprocess, batch.frames[first]);
        for (int64_t p = first + 1; p < pos; ++p) batch.frames[p].copy_(batch.frames[first]);
        for (int64_t p : owed) batch.frames[p].copy_(batch.frames[first]);
        owed.clear();
        last_good = pos - 1;
        continue;
      }
      const std::string what = describe(index, t) + ": " + item->why;
      LVX_CHECK(options.on_corrupt != CorruptPolicy::kError, "video '", path, "': ", what,
                " (use --on-corrupt skip|repeat to continue past damaged frames)");
      for (int64_t p = first; p < pos; ++p) {
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
      report.events.push_back(what + (options.on_corrupt == CorruptPolicy::kSkip
                                          ? "; skipped"
                                          : "; replaced by the nearest good sampled frame"));
    }
  } catch (...) {
    queue.cancel();
    producer.join();
    throw;
  }
  producer.join();
  LVX_CHECK(pos == n, "video '", path, "': internal error: ", pos, " of ", n,
            " sampled frames were produced");
  LVX_CHECK(owed.empty() || n == 0, "video '", path,
            "': none of the sampled frames could be decoded");
  // Repeated frames report the index and pts of the frame that was asked for; the pixels are
  // the neighbour's. Skipped frames are removed.
  batch.indices = at::from_blob(out_index.data(), {n}, at::kLong).clone();
  batch.pts = at::from_blob(out_pts.data(), {n}, at::kDouble).clone();
  if (report.skipped > 0) {
    std::vector<int64_t> kept;
    for (int64_t p = 0; p < n; ++p)
      if (keep[p]) kept.push_back(p);
    const at::Tensor sel =
        at::from_blob(kept.data(), {static_cast<int64_t>(kept.size())}, at::kLong).clone();
    batch.frames = batch.frames.index_select(0, sel);
    batch.indices = batch.indices.index_select(0, sel);
    batch.pts = batch.pts.index_select(0, sel);
  }
  report.stats = decoder.stats();
  return batch;
}

}  // namespace lvx::video
