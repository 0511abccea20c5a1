// Processor-exact resize, crop/pad and normalize (see preprocess.h).
#include "video/preprocess.h"

#include <cmath>
#include <opencv2/core.hpp>
#include <vector>

#include "src/common/error.h"

namespace lvx::video {
namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;  // PIL Resample.c PRECISION_BITS

double bicubic(double x) {  // PIL's cubic with a = -0.5
  constexpr double a = -0.5;
  if (x < 0) x = -x;
  if (x < 1) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2) return (((x - 5) * x + 8) * x - 4) * a;
  return 0;
}

// Fixed-point weights for one axis (PIL precompute_coeffs + normalize_coeffs_8bpc).
struct Coeffs {
  int ksize = 0;
  std::vector<int> bounds;  // per output: xmin, count
  std::vector<int> k;       // per output: ksize weights
};

Coeffs precompute(int in_size, int out_size) {
  Coeffs c;
  const double scale = static_cast<double>(in_size) / out_size;
  const double filterscale = scale < 1.0 ? 1.0 : scale;
  const double support = 2.0 * filterscale;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.bounds.resize(2 * out_size);
  c.k.assign(static_cast<size_t>(out_size) * c.ksize, 0);
  std::vector<double> w(c.ksize);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0;
    for (int x = 0; x < xmax; ++x) {
      w[x] = bicubic((x + xmin - center + 0.5) * ss);
      ww += w[x];
    }
    for (int x = 0; x < xmax; ++x) {
      const double v = (ww != 0.0 ? w[x] / ww : w[x]) * (1 << kPrecisionBits);
      c.k[static_cast<size_t>(xx) * c.ksize + x] = static_cast<int>(v < 0 ? v - 0.5 : v + 0.5);
    }
    c.bounds[2 * xx] = xmin;
    c.bounds[2 * xx + 1] = xmax;
  }
  return c;
}

inline uint8_t clip8(int v) {
  v >>= kPrecisionBits;
  return static_cast<uint8_t>(v < 0 ? 0 : (v > 255 ? 255 : v));
}

cv::Mat resample_horizontal(const cv::Mat& in, int out_w) {
  const Coeffs c = precompute(in.cols, out_w);
  cv::Mat out(in.rows, out_w, CV_8UC3);
  for (int y = 0; y < in.rows; ++y) {
    const uint8_t* src = in.ptr<uint8_t>(y);
    uint8_t* dst = out.ptr<uint8_t>(y);
    for (int xx = 0; xx < out_w; ++xx) {
      const int xmin = c.bounds[2 * xx], n = c.bounds[2 * xx + 1];
      const int* k = &c.k[static_cast<size_t>(xx) * c.ksize];
      int s0 = 1 << (kPrecisionBits - 1), s1 = s0, s2 = s0;
      for (int x = 0; x < n; ++x) {
        const uint8_t* p = src + 3 * (x + xmin);
        s0 += p[0] * k[x];
        s1 += p[1] * k[x];
        s2 += p[2] * k[x];
      }
      dst[3 * xx] = clip8(s0);
      dst[3 * xx + 1] = clip8(s1);
      dst[3 * xx + 2] = clip8(s2);
    }
  }
  return out;
}

cv::Mat resample_vertical(const cv::Mat& in, int out_h) {
  const Coeffs c = precompute(in.rows, out_h);
  cv::Mat out(out_h, in.cols, CV_8UC3);
  const int row = in.cols * 3;
  std::vector<int> acc(row);
  for (int yy = 0; yy < out_h; ++yy) {
    const int ymin = c.bounds[2 * yy], n = c.bounds[2 * yy + 1];
    const int* k = &c.k[static_cast<size_t>(yy) * c.ksize];
    std::fill(acc.begin(), acc.end(), 1 << (kPrecisionBits - 1));
    for (int y = 0; y < n; ++y) {
      const uint8_t* src = in.ptr<uint8_t>(y + ymin);
      const int w = k[y];
      for (int x = 0; x < row; ++x) acc[x] += src[x] * w;
    }
    uint8_t* dst = out.ptr<uint8_t>(yy);
    for (int x = 0; x < row; ++x) dst[x] = clip8(acc[x]);
  }
  return out;
}

}  // namespace

cv::Mat resize_bicubic_pil(const cv::Mat& rgb, int out_w, int out_h) {
  LVX_CHECK(rgb.type() == CV_8UC3, "resize: expected an RGB24 image (CV_8UC3)");
  LVX_CHECK(out_w > 0 && out_h > 0, "resize: output size must be positive, got ", out_w, "x",
            out_h);
  cv::Mat cur = rgb;
  // PIL resamples only the axes whose size changes, horizontal first.
  if (out_w != cur.cols) cur = resample_horizontal(cur, out_w);
  if (out_h != cur.rows) cur = resample_vertical(cur, out_h);
  return cur.data == rgb.data ? rgb.clone() : cur;
}

std::pair<int64_t, int64_t> preprocessed_size(const PreprocessConfig& cfg, int64_t in_h,
                                              int64_t in_w) {
  if (cfg.image_size <= 0) return {in_h, in_w};
  return {cfg.image_size, cfg.image_size};
}

void preprocess_frame(const cv::Mat& rgb, const PreprocessConfig& cfg, at::Tensor out) {
  cv::Mat img = rgb;
  const int s = static_cast<int>(cfg.image_size);
  if (s > 0) {
    switch (cfg.resize) {
      case ResizeMode::kSquash:
        img = resize_bicubic_pil(img, s, s);
        break;
      case ResizeMode::kShortestEdge: {
        // torchvision Resize(int) / CLIPImageProcessor: short side → s, long side truncated.
        const bool wide = img.cols >= img.rows;
        const int short_side = wide ? img.rows : img.cols, long_side = wide ? img.cols : img.rows;
        const int new_long = static_cast<int>(static_cast<int64_t>(s) * long_side / short_side);
        img = wide ? resize_bicubic_pil(img, new_long, s) : resize_bicubic_pil(img, s, new_long);
        // torchvision center_crop: offsets int(round((in - out) / 2)), round half to even.
        const int top = static_cast<int>(std::nearbyint((img.rows - s) / 2.0));
        const int left = static_cast<int>(std::nearbyint((img.cols - s) / 2.0));
        img = img(cv::Rect(left, top, s, s)).clone();
        break;
      }
      case ResizeMode::kPad: {
        // LLaVA expand2square: paste centred ((side - w) // 2) on a mean-coloured square.
        const int side = std::max(img.cols, img.rows);
        const cv::Scalar fill(static_cast<int>(cfg.mean[0] * 255),
                              static_cast<int>(cfg.mean[1] * 255),
                              static_cast<int>(cfg.mean[2] * 255));
        cv::Mat square(side, side, CV_8UC3, fill);
        img.copyTo(
            square(cv::Rect((side - img.cols) / 2, (side - img.rows) / 2, img.cols, img.rows)));
        img = resize_bicubic_pil(square, s, s);
        break;
      }
    }
  }
  const int64_t h = img.rows, w = img.cols;
  LVX_CHECK(out.dim() == 3 && out.size(0) == 3 && out.size(1) == h && out.size(2) == w,
            "preprocess: output slot must be [3, ", h, ", ", w, "], got ", out.sizes());
  // HWC uint8 → CHW (uint8, or float32 (x / 255 - mean) / std as ToTensor then Normalize).
  for (int c = 0; c < 3; ++c) {
    if (!cfg.normalize) {
      uint8_t* dst = out[c].data_ptr<uint8_t>();
      for (int64_t y = 0; y < h; ++y) {
        const uint8_t* src = img.ptr<uint8_t>(static_cast<int>(y));
        for (int64_t x = 0; x < w; ++x) dst[y * w + x] = src[3 * x + c];
      }
    } else {
      // The function of one uint8 value, tabulated: bit-identical to computing it per pixel.
      float lut[256];
      for (int v = 0; v < 256; ++v)
        lut[v] = (static_cast<float>(v) / 255.0f - cfg.mean[c]) / cfg.std[c];
      float* dst = out[c].data_ptr<float>();
      for (int64_t y = 0; y < h; ++y) {
        const uint8_t* src = img.ptr<uint8_t>(static_cast<int>(y));
        for (int64_t x = 0; x < w; ++x) dst[y * w + x] = lut[src[3 * x + c]];
      }
    }
  }
}

}  // namespace lvx::video
