// The media of one question of lvx qa / lvx serve: a list of frame images decoded as this
// rank's share, and the visual cache's key of a request (its content's hash, never a client's
// name for it).
#pragma once

#include <string>
#include <vector>

#include "src/runtime/qa_job.h"
#include "video/pipeline.h"

namespace lvx::runtime {

// This rank's share of `files` (one frame each, in order): each decoded as a one-frame video and
// preprocessed like a video's frames. indices and pts are the frames' positions in the list.
video::FrameBatch decode_images(const std::vector<std::string>& files,
                                const video::ShardSpec& shard,
                                const video::PreprocessConfig& preprocess);

// The content key of a file: XXH3-128 keyed by the process's content secret (file_keyed_xxh3;
// set_content_secret), hashed again only when the file may have changed (its device, inode, size,
// modification and status-change times are kept with the hash). Thread-safe.
std::string content_hash(const std::string& path);

// The secret content_hash keys with (at least 136 bytes; every rank of a session the same, so that
// a hash rank 0 names is each rank's). Until set: a fixed one (lvx qa's own runs). Forgets the
// hashes made under the previous secret.
void set_content_secret(const std::string& secret);
std::string content_secret();

// The decoder's options of a request (its frame-index cache: off for uploads).
video::DecodeOptions decode_options(const QaRequest& req);

// The content hash of the request's video: the one it names (media_hash), or its file's.
std::string video_hash(const QaRequest& req);

// The visual cache's key of a request on this rank: the content's hash (always: a client's
// video_id names a video but never stands in for its bytes, so no id reaches another client's
// features or a stale entry), the sampling, the preprocessing, the dtype and the rank's place.
std::string visual_key(const QaRequest& req, const video::SampleSpec& spec,
                       const video::PreprocessConfig& pre, const std::string& dtype, int rank,
                       int world);

}  // namespace lvx::runtime
