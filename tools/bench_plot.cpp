// The SVG plot of `lvx bench-plan`; see bench_plot.h.
#include "tools/bench_plot.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "src/common/error.h"

namespace lvx::tools {

// predicted against measured time per (layer, strategy), log-log, with the diagonal: a point on
// it is a perfect prediction; the planner's choice is ringed, the fastest measured filled black.
void write_plot(const std::string& path, const std::vector<Point>& pts, const std::string& title) {
  LVX_CHECK(!pts.empty(), "--plot: nothing was measured");
  double lo = 1e300, hi = 0;
  for (const auto& p : pts) {
    lo = std::min({lo, p.predicted_s, p.measured_s});
    hi = std::max({hi, p.predicted_s, p.measured_s});
  }
  lo = std::pow(10, std::floor(std::log10(lo)));
  hi = std::pow(10, std::ceil(std::log10(hi)));
  const double W = 720, H = 560, L = 80, R = 200, T = 40, B = 60;
  auto x = [&](double v) {
    return L + (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo)) * (W - L - R);
  };
  auto y = [&](double v) {
    return H - B -
           (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo)) * (H - T - B);
  };
  const std::map<std::string, std::string> colours = {
      {"lv_xattn", "#1f77b4"}, {"ring", "#ff7f0e"},       {"striped", "#2ca02c"},
      {"ulysses", "#d62728"},  {"all_gather", "#9467bd"}, {"distflash", "#8c564b"}};
  auto colour = [&](const std::string& s) {
    auto it = colours.find(s);
    return it != colours.end() ? it->second : std::string("#7f7f7f");  // a forward+backward pair
  };
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
       "fill=\"white\"/>\n"
    << "<text x=\"" << L << "\" y=\"24\" font-size=\"14\">" << title << "</text>\n";
  for (double d = lo; d <= hi * 1.0001; d *= 10) {
    o << "<line x1=\"" << x(d) << "\" y1=\"" << T << "\" x2=\"" << x(d) << "\" y2=\"" << H - B
      << "\" stroke=\"#ddd\"/><text x=\"" << x(d) << "\" y=\"" << H - B + 16
      << "\" text-anchor=\"middle\">" << d << "</text>\n";
    o << "<line x1=\"" << L << "\" y1=\"" << y(d) << "\" x2=\"" << W - R << "\" y2=\"" << y(d)
      << "\" stroke=\"#ddd\"/><text x=\"" << L - 6 << "\" y=\"" << y(d) + 4
      << "\" text-anchor=\"end\">" << d << "</text>\n";
  }
  o << "<line x1=\"" << x(lo) << "\" y1=\"" << y(lo) << "\" x2=\"" << x(hi) << "\" y2=\"" << y(hi)
    << "\" stroke=\"black\" stroke-dasharray=\"4 3\"/>\n";
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 20
    << "\" text-anchor=\"middle\">predicted seconds (forward + backward)</text>\n";
  o << "<text transform=\"translate(20," << (T + H - B) / 2
    << ") rotate(-90)\" text-anchor=\"middle\">measured seconds</text>\n";
  for (const auto& p : pts) {
    o << "<circle cx=\"" << x(p.predicted_s) << "\" cy=\"" << y(p.measured_s)
      << "\" r=\"5\" fill=\"" << (p.fastest ? "black" : colour(p.strategy)) << "\" stroke=\""
      << colour(p.strategy) << "\" stroke-width=\"2\"><title>" << p.layer << " " << p.strategy
      << ": predicted " << p.predicted_s << " s, measured " << p.measured_s
      << " s</title></circle>\n";
    if (p.choice)
      o << "<circle cx=\"" << x(p.predicted_s) << "\" cy=\"" << y(p.measured_s)
        << "\" r=\"9\" fill=\"none\" stroke=\"black\"/>\n";
  }
  double ly = T + 10;
  for (const auto& [name, c] : colours) {
    o << "<circle cx=\"" << W - R + 20 << "\" cy=\"" << ly << "\" r=\"5\" fill=\"" << c
      << "\"/><text x=\"" << W - R + 32 << "\" y=\"" << ly + 4 << "\">" << name << "</text>\n";
    ly += 18;
  }
  o << "<circle cx=\"" << W - R + 20 << "\" cy=\"" << ly
    << "\" r=\"5\" fill=\"#7f7f7f\"/><text x=\"" << W - R + 32 << "\" y=\"" << ly + 4
    << "\">forward+backward pair</text>\n";
  ly += 18;
  o << "<circle cx=\"" << W - R + 20 << "\" cy=\"" << ly
    << "\" r=\"9\" fill=\"none\" stroke=\"black\"/><text x=\"" << W - R + 32 << "\" y=\"" << ly + 4
    << "\">planner's choice</text>\n";
  ly += 18;
  o << "<circle cx=\"" << W - R + 20 << "\" cy=\"" << ly << "\" r=\"5\" fill=\"black\"/><text x=\""
    << W - R + 32 << "\" y=\"" << ly + 4 << "\">fastest measured</text>\n";
  o << "</svg>\n";
  const std::string tmp = path + ".tmp";
  std::ofstream f(tmp);
  f << o.str();
  LVX_CHECK(f.good(), "--plot: cannot write '", path, "'");
  f.close();
  std::filesystem::rename(tmp, path);
}

}  // namespace lvx::tools
