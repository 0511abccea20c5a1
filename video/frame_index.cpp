// Packet scan → presentation-order frame index (see frame_index.h).
#include "video/frame_index.h"

#include <algorithm>
#include <numeric>

namespace lvx::video {

int64_t FrameIndex::keyframe_before(int64_t i) const {
  for (int64_t k = i; k >= 0; --k)
    if (keyframe[k]) return k;
  return 0;
}

int64_t FrameIndex::find_pts(int64_t p) const {
  auto it = std::lower_bound(pts.begin(), pts.end(), p);
  if (it == pts.end() || *it != p) return -1;
  return it - pts.begin();
}

Timeline FrameIndex::timeline() const {
  Timeline t;
  t.pts.resize(pts.size());
  for (size_t i = 0; i < pts.size(); ++i) t.pts[i] = pts_seconds(static_cast<int64_t>(i));
  t.end = end_seconds();
  return t;
}

FrameIndex scan_frame_index(AVFormatContext* fmt, int stream_index, const std::string& path) {
  struct Entry {
    int64_t pts, duration;
    bool key;
  };
  std::vector<Entry> entries;
  FrameIndex index;
  index.time_base = fmt->streams[stream_index]->time_base;
  UniqueAVPacket pkt = make_av_packet();
  while (true) {
    const int status = av_read_frame(fmt, pkt.get());
    if (status == AVERROR_EOF) break;
    if (status < 0) {
      index.truncated = true;
      index.truncation_reason = lvx::str("reading packets stopped after ", entries.size(),
                                         " frames: ", av_error_string(status));
      break;
    }
    PacketUnref unref(pkt.get());
    if (pkt->stream_index != stream_index || (pkt->flags & AV_PKT_FLAG_DISCARD)) continue;
    const int64_t ts = pkt->pts != AV_NOPTS_VALUE ? pkt->pts : pkt->dts;
    if (ts == AV_NOPTS_VALUE) continue;  // cannot be placed in time (e.g. an empty N-VOP)
    if (pkt->flags & AV_PKT_FLAG_CORRUPT) {
      // A packet the demuxer knows is incomplete: the file was cut inside it.
      index.truncated = true;
      index.truncation_reason =
          lvx::str("packet of frame ", entries.size(), " is incomplete (file cut short)");
      continue;
    }
    entries.push_back({ts, pkt->duration, (pkt->flags & AV_PKT_FLAG_KEY) != 0});
  }
  LVX_CHECK(!entries.empty(), "video '", path, "': the video stream holds no frames",
            index.truncated ? " (" + index.truncation_reason + ")" : std::string());
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return a.pts < b.pts; });
  // Frames sharing a pts cannot both be shown; keep the first (the decoder outputs one of them).
  entries.erase(std::unique(entries.begin(), entries.end(),
                            [](const Entry& a, const Entry& b) { return a.pts == b.pts; }),
                entries.end());
  const size_t n = entries.size();
  index.pts.resize(n);
  index.keyframe.resize(n);
  for (size_t i = 0; i < n; ++i) {
    index.pts[i] = entries[i].pts;
    index.keyframe[i] = entries[i].key;
  }
  // The end of the stream: last pts plus the last frame's duration; when the container does not
  // say, the median gap between frames (robust to a few variable-rate gaps).
  int64_t last_duration = entries.back().duration;
  if (last_duration <= 0) {
    if (n >= 2) {
      std::vector<int64_t> gaps(n - 1);
      for (size_t i = 1; i < n; ++i) gaps[i - 1] = entries[i].pts - entries[i - 1].pts;
      std::nth_element(gaps.begin(), gaps.begin() + gaps.size() / 2, gaps.end());
      last_duration = gaps[gaps.size() / 2];
    } else {
      last_duration = 1;
    }
  }
  index.end_pts = entries.back().pts + last_duration;
  return index;
}

}  // namespace lvx::video
