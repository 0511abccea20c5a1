#include "models/parallel.h"

namespace lvx::models {

Parallel resolve_layouts(Parallel p) {
  using attention::StrategyKind;
  bool striped = false;
  for (const auto& l : p.layers)
    striped = striped || l.self.forward == StrategyKind::kStriped ||
              l.self.backward == StrategyKind::kStriped;
  if (striped) p.text_layout = attention::LayoutKind::kStriped;
  auto as_ring = [](attention::StrategyChoice c) {
    if (c.forward == StrategyKind::kStriped) c.forward = StrategyKind::kRing;
    if (c.backward == StrategyKind::kStriped) c.backward = StrategyKind::kRing;
    return c;
  };
  for (auto& l : p.layers) {
    l.self = as_ring(l.self);
    l.cross = as_ring(l.cross);
  }
  return p;
}

}  // namespace lvx::models
