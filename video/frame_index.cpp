// Packet scan → presentation-order frame index (see frame_index.h).
#include "video/frame_index.h"

#include <algorithm>
#include <numeric>

namespace lvx::video {
namespace {

// The end the container states for the stream (stream time base), or AV_NOPTS_VALUE. A duration
// guessed from the bitrate is a guess, not a statement, and is ignored. The stream's own
// duration is preferred; the file's is used otherwise (matroska states only that one). Some
// muxers write the last timestamp as the "duration" of a stream that starts late (matroska with
// an offset), so *as_end also gives the duration read as an end time.
int64_t stated_end(const AVFormatContext* fmt, const AVStream* st, int64_t first_pts,
                   int64_t* as_end) {
  *as_end = AV_NOPTS_VALUE;
  if (fmt->duration_estimation_method == AVFMT_DURATION_FROM_BITRATE) return AV_NOPTS_VALUE;
  if (st->duration != AV_NOPTS_VALUE && st->duration > 0) {
    *as_end = st->duration;
    return (st->start_time != AV_NOPTS_VALUE ? st->start_time : first_pts) + st->duration;
  }
  if (fmt->duration != AV_NOPTS_VALUE && fmt->duration > 0) {
    const int64_t start_us = fmt->start_time != AV_NOPTS_VALUE
                                 ? fmt->start_time
                                 : av_rescale_q(first_pts, st->time_base, AV_TIME_BASE_Q);
    *as_end = av_rescale_q(fmt->duration, AV_TIME_BASE_Q, st->time_base);
    return av_rescale_q(start_us + fmt->duration, AV_TIME_BASE_Q, st->time_base);
  }
  return AV_NOPTS_VALUE;
}

}  // namespace

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
  for (size_t i = 0; i < pts.size(); ++i) t.pts[i] = time_seconds(static_cast<int64_t>(i));
  t.end = duration_seconds();
  return t;
}

namespace {

struct Entry {
  int64_t pts, dts, pos, duration;
  bool key;
};

// Packets that carry a dts but no pts (MPEG program streams write a pts on some packets only),
// in decode order. Without reordering a frame shows when it is decoded: pts = dts. With B-frame
// reordering (the stream says so, or a packet's pts differs from its dts) a reference frame shows
// when the next reference frame is decoded (MPEG's one-frame reorder delay), so its pts is the
// dts of the next packet that is a reference frame (a keyframe, a packet without pts, or one whose
// pts differs from its dts); the last one shows one frame after the stream's latest time.
void fill_missing_pts(std::vector<Entry>& entries, bool stream_reorders) {
  bool reorders = stream_reorders;
  for (const Entry& e : entries)
    if (e.pts != AV_NOPTS_VALUE && e.dts != AV_NOPTS_VALUE && e.pts != e.dts) reorders = true;
  int64_t next_ref_dts = AV_NOPTS_VALUE, latest = AV_NOPTS_VALUE, gap = 0;
  for (size_t i = 1; i < entries.size() && gap <= 0; ++i)
    if (entries[i].dts != AV_NOPTS_VALUE && entries[i - 1].dts != AV_NOPTS_VALUE)
      gap = entries[i].dts - entries[i - 1].dts;
  for (const Entry& e : entries)  // AV_NOPTS_VALUE is INT64_MIN: any time is later
    latest = std::max({latest, e.pts, e.dts});
  for (size_t j = entries.size(); j-- > 0;) {
    Entry& e = entries[j];
    const bool had_pts = e.pts != AV_NOPTS_VALUE;
    if (!had_pts) {
      if (!reorders)
        e.pts = e.dts;
      else
        e.pts = next_ref_dts != AV_NOPTS_VALUE ? next_ref_dts
                                               : latest + (e.duration > 0 ? e.duration : gap);
    }
    if (e.key || !had_pts || e.pts != e.dts) next_ref_dts = e.dts;
  }
}

// The stream's packets in decode order (those that can be placed); a read error or a packet the
// demuxer marks incomplete sets index.truncated.
std::vector<Entry> read_entries(AVFormatContext* fmt, int stream_index, FrameIndex& index) {
  std::vector<Entry> entries;
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
    // A packet with neither time cannot be placed (e.g. an empty N-VOP); one with a dts only
    // gets its pts below, once the packets after it are known.
    if (pkt->pts == AV_NOPTS_VALUE && pkt->dts == AV_NOPTS_VALUE) continue;
    if (pkt->flags & AV_PKT_FLAG_CORRUPT) {
      // A packet the demuxer knows is incomplete: the file was cut inside it.
      index.truncated = true;
      index.truncation_reason =
          lvx::str("packet of frame ", entries.size(), " is incomplete (file cut short)");
      continue;
    }
    entries.push_back(
        {pkt->pts, pkt->dts, pkt->pos, pkt->duration, (pkt->flags & AV_PKT_FLAG_KEY) != 0});
  }
  return entries;
}

// The entries in presentation order, one per pts.
void sort_by_pts(std::vector<Entry>& entries) {
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return a.pts < b.pts; });
  // Frames sharing a pts cannot both be shown; keep the first (the decoder outputs one of them).
  entries.erase(std::unique(entries.begin(), entries.end(),
                            [](const Entry& a, const Entry& b) { return a.pts == b.pts; }),
                entries.end());
}

// The entries' columns copied into the index (pts, dts, pos, keyframe).
void copy_columns(const std::vector<Entry>& entries, FrameIndex& index) {
  const size_t n = entries.size();
  index.pts.resize(n);
  index.dts.resize(n);
  index.pos.resize(n);
  index.keyframe.resize(n);
  for (size_t i = 0; i < n; ++i) {
    index.pts[i] = entries[i].pts;
    index.dts[i] = entries[i].dts;
    index.pos[i] = entries[i].pos;
    index.keyframe[i] = entries[i].key;
  }
}

// The last frame's own duration; when the container does not say, the median gap between
// frames (robust to a few variable-rate gaps).
int64_t last_frame_duration(const std::vector<Entry>& entries) {
  const size_t n = entries.size();
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
  return last_duration;
}

// index.end_pts: the container's stated end (or its duration read as an end) when it falls
// inside the last frame's display, else the frames' end.
void choose_end(FrameIndex& index, int64_t stated, int64_t stated_as_end, int64_t last_pts,
                int64_t frames_end) {
  index.end_pts = frames_end;
  for (int64_t end : {stated, stated_as_end}) {
    if (end != AV_NOPTS_VALUE && end > last_pts && end <= frames_end) {
      index.end_pts = end;
      index.end_from_container = true;
      break;
    }
  }
}

// Some containers (matroska, avi) just report end of file when cut inside a cluster: the only
// trace is that the frames stop well before the duration the header promised. Only the
// stream's own duration, or the file's when the video is its only stream, is a promise about
// the video (audio can be longer).
void check_cut_short(const AVFormatContext* fmt, const AVStream* st, FrameIndex& index,
                     int64_t stated, int64_t stated_as_end, int64_t frames_end) {
  if (!index.truncated && stated != AV_NOPTS_VALUE &&
      (st->duration != AV_NOPTS_VALUE || fmt->nb_streams == 1)) {
    const double header_end = pts_to_seconds(std::min(stated, stated_as_end), st->time_base);
    const double content_end = pts_to_seconds(frames_end, st->time_base);
    if (content_end < header_end - std::max(0.5, 0.02 * (header_end - index.pts_seconds(0)))) {
      index.truncated = true;
      index.truncation_reason =
          lvx::str("the frames end at ", content_end, " s but the container header says ",
                   header_end, " s (file cut short?)");
    }
  }
}

}  // namespace

FrameIndex scan_frame_index(AVFormatContext* fmt, int stream_index, const std::string& path) {
  FrameIndex index;
  const AVStream* st = fmt->streams[stream_index];
  index.time_base = st->time_base;
  std::vector<Entry> entries = read_entries(fmt, stream_index, index);
  fill_missing_pts(entries, st->codecpar->video_delay > 0);
  LVX_CHECK(!entries.empty(), "video '", path, "': the video stream holds no frames",
            index.truncated ? " (" + index.truncation_reason + ")" : std::string());
  sort_by_pts(entries);
  copy_columns(entries, index);
  const int64_t last_duration = last_frame_duration(entries);
  const int64_t last_pts = entries.back().pts;
  const int64_t frames_end = last_pts + last_duration;
  // The video ends where its last frame stops being shown. The container's stated end wins when
  // it falls inside the last frame's display (packets may claim a longer last frame than the
  // file plays: a frame past the stated end must not be sampled); an end before the last frame
  // or after its own duration is inconsistent and the frames decide.
  int64_t stated_as_end = AV_NOPTS_VALUE;
  const int64_t stated = stated_end(fmt, st, index.pts[0], &stated_as_end);
  choose_end(index, stated, stated_as_end, last_pts, frames_end);
  check_cut_short(fmt, st, index, stated, stated_as_end, frames_end);
  return index;
}

}  // namespace lvx::video
