// Option parsing and the model presets (see video_options.h).
#include "video/video_options.h"

#include "src/common/error.h"

namespace lvx::video {

CorruptPolicy parse_corrupt_policy(const std::string& s) {
  if (s == "error") return CorruptPolicy::kError;
  if (s == "skip") return CorruptPolicy::kSkip;
  if (s == "repeat") return CorruptPolicy::kRepeat;
  LVX_FAIL("corrupt-frame policy must be error, skip or repeat, got '", s, "'");
}

const char* to_string(CorruptPolicy p) {
  switch (p) {
    case CorruptPolicy::kError:
      return "error";
    case CorruptPolicy::kSkip:
      return "skip";
    case CorruptPolicy::kRepeat:
      return "repeat";
  }
  return "?";
}

ResizeMode parse_resize_mode(const std::string& s) {
  if (s == "squash") return ResizeMode::kSquash;
  if (s == "shortest-edge") return ResizeMode::kShortestEdge;
  if (s == "pad") return ResizeMode::kPad;
  LVX_FAIL("resize mode must be squash, shortest-edge or pad, got '", s, "'");
}

const char* to_string(ResizeMode m) {
  switch (m) {
    case ResizeMode::kSquash:
      return "squash";
    case ResizeMode::kShortestEdge:
      return "shortest-edge";
    case ResizeMode::kPad:
      return "pad";
  }
  return "?";
}

PreprocessConfig PreprocessConfig::siglip() {
  PreprocessConfig c;
  c.image_size = 384;
  c.resize = ResizeMode::kSquash;
  c.mean = {0.5f, 0.5f, 0.5f};
  c.std = {0.5f, 0.5f, 0.5f};
  return c;
}

PreprocessConfig PreprocessConfig::clip() {
  PreprocessConfig c;
  c.image_size = 224;
  c.resize = ResizeMode::kShortestEdge;
  c.mean = {0.48145466f, 0.4578275f, 0.40821073f};  // OPENAI_DATASET_MEAN (open_clip)
  c.std = {0.26862954f, 0.26130258f, 0.27577711f};  // OPENAI_DATASET_STD
  return c;
}

PreprocessConfig PreprocessConfig::preset(const std::string& name) {
  if (name == "siglip") return siglip();
  if (name == "clip") return clip();
  LVX_FAIL("preprocessing preset must be siglip or clip, got '", name, "'");
}

}  // namespace lvx::video
