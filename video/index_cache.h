// One frame index per video, not one per rank or per run: the packet scan of a long video costs
// more than decoding the few frames sampled from it, so its result is kept in a cache file keyed
// by the video's real path, size, modification time (ns), device and inode. The first process
// to need an index takes an exclusive lock on the entry, scans and writes it atomically (temp
// file + rename); every other rank waits on the lock and reads it. A changed file has a
// different key and is scanned again; a corrupt or foreign entry (bad magic, checksum, sizes)
// is rebuilt. The directory is $LVX_INDEX_CACHE, else $XDG_CACHE_HOME/lvx/index, else
// ~/.cache/lvx/index; LVX_INDEX_CACHE=off disables the cache. When the directory cannot be
// used (read-only, no HOME) the index is scanned as if there were no cache.
#pragma once

#include <string>

#include "video/frame_index.h"

namespace lvx::video {

// The cache directory in effect, or "" when disabled or undeterminable.
std::string index_cache_dir();

// The cache file that holds the index of `stream_index` of `path` ("" without a cache dir).
std::string index_cache_file(const std::string& path, int stream_index);

// The index of `stream_index` of `path` (opened as `fmt`, positioned at the start): read from the
// cache when `use_cache` and a valid entry exists (*from_cache = true), else scanned with
// scan_frame_index and, when `use_cache`, stored.
FrameIndex load_or_scan_frame_index(AVFormatContext* fmt, int stream_index, const std::string& path,
                                    bool use_cache, bool* from_cache);

}  // namespace lvx::video
