// The plot of `lvx bench-plan --plot`: predicted against measured time per (layer, strategy) as an
// SVG drawn here (log-log, with the diagonal of perfect predictions), no plotting package needed.
#pragma once

#include <string>
#include <vector>

namespace lvx::tools {

// One measured (layer, strategy) point, for the table, the JSON and the plot.
struct Point {
  std::string layer, strategy;
  double predicted_s = 0, measured_s = 0;
  bool choice = false, fastest = false;
};

// Writes the SVG to `path`: one point per (layer, strategy); the planner's choice is ringed, the
// fastest measured filled black. Throws lvx::Error when pts is empty or the file cannot be written.
void write_plot(const std::string& path, const std::vector<Point>& pts, const std::string& title);

}  // namespace lvx::tools
