// Image preprocessing as the vision towers' processors do it, on RGB24 frames:
//   resize    bicubic exactly as PIL's Image.resize(BICUBIC) (what CLIPImageProcessor,
//             SiglipImageProcessor, open_clip and mPLUG-Owl3's torchvision Resize all call on
//             uint8 images): a = -0.5 cubic, support widened by the scale when shrinking
//             (antialiasing), 22-bit fixed-point weights, horizontal pass then vertical, each
//             rounded to uint8. OpenCV's INTER_CUBIC (a = -0.75, no antialias) differs by tens
//             of levels when shrinking, so it is not used for the resize itself.
//   crop/pad  shortest edge → S then centre crop S×S (torchvision rounding), squash to S×S,
//             or pad to a square with the mean colour first (LLaVA expand2square).
//   normalize float32 (x / 255 - mean) / std per channel.
// Output layout is [3, H, W] per frame (the pipeline stacks them to [N, 3, H, W]).
#pragma once

#include <ATen/ATen.h>

#include <opencv2/core.hpp>

#include "video/video_options.h"

namespace lvx::video {

// PIL-compatible bicubic resize of a CV_8UC3 image to out_w × out_h.
cv::Mat resize_bicubic_pil(const cv::Mat& rgb, int out_w, int out_h);

// Output H, W for an input of in_h × in_w under `cfg` (image_size 0 keeps the input size).
std::pair<int64_t, int64_t> preprocessed_size(const PreprocessConfig& cfg, int64_t in_h,
                                              int64_t in_w);

// Applies `cfg` to one frame and writes it into `out`, a [3, H, W] tensor (uint8 when
// cfg.normalize is false, float32 when true) — typically a slice of the batch tensor.
void preprocess_frame(const cv::Mat& rgb, const PreprocessConfig& cfg, at::Tensor out);

}  // namespace lvx::video
