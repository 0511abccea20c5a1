#include "models/mllama/mask.h"

#include <algorithm>
#include <numeric>
#include <set>

#include "src/common/error.h"

namespace lvx::models::mllama {

namespace {

// One sample's rows and tiles sorted into families of nested sets (mask.h).
struct Families {
  std::vector<int32_t> row_family, row_level;    // [L]: −1 family: the row sees no tile
  std::vector<int32_t> unit_family, unit_level;  // [U]: −1 family: no row sees the tile
  int32_t count = 0;
};

Families families_of(const at::Tensor& rows, int64_t b, int64_t tiles, const std::string& where) {
  const int64_t L = rows.size(0), U = rows.size(1);
  Families f;
  f.row_family.assign(L, -1);
  f.row_level.assign(L, -1);
  f.unit_family.assign(U, -1);
  f.unit_level.assign(U, -1);
  const auto [sets, inverse, counts] = at::unique_dim(rows, 0, /*sorted=*/true,
                                                      /*return_inverse=*/true);
  (void)counts;
  const at::Tensor sizes = sets.sum(1);
  const int64_t n = sets.size(0);
  std::vector<int64_t> order(n), first_row(n, -1);
  std::iota(order.begin(), order.end(), 0);
  const auto* sz = sizes.data_ptr<int64_t>();
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return sz[a] < sz[c]; });
  const auto* inv = inverse.data_ptr<int64_t>();
  for (int64_t t = L - 1; t >= 0; --t) first_row[inv[t]] = t;
  std::vector<int32_t> set_family(n, -1), set_level(n, -1);
  std::vector<int64_t> top_size, top_set;  // per family: its largest set so far
  std::vector<int32_t> level;
  auto unit_name = [&](int64_t u) { return str("(image ", u / tiles, ", tile ", u % tiles, ")"); };
  for (const int64_t s : order) {
    if (sz[s] == 0) continue;
    const at::Tensor units_t = sets[s].nonzero().view({-1});
    const auto* units = units_t.data_ptr<int64_t>();
    const int64_t k = units_t.numel();
    std::set<int32_t> touched;
    int64_t in_family = 0;
    for (int64_t i = 0; i < k; ++i)
      if (f.unit_family[units[i]] >= 0) touched.insert(f.unit_family[units[i]]);
    int32_t fam;
    if (touched.empty()) {
      fam = f.count++;
      top_size.push_back(0);
      top_set.push_back(-1);
      level.push_back(-1);
    } else {
      fam = *touched.begin();
      for (int64_t i = 0; i < k; ++i) in_family += f.unit_family[units[i]] == fam;
      LVX_CHECK(touched.size() == 1 && in_family == top_size[fam], where,
                ": cross_attention_mask: sample ", b, " rows ", first_row[s], " and ",
                first_row[top_set[fam]],
                " see sets of (image, tile) that overlap without one containing the other (e.g. ",
                unit_name(units[0]),
                "); lvx runs a sample's cross-attention as nested sets of tiles, as "
                "MllamaProcessor makes them");
    }
    const int32_t lv = ++level[fam];
    for (int64_t i = 0; i < k; ++i)
      if (f.unit_family[units[i]] < 0) {
        f.unit_family[units[i]] = fam;
        f.unit_level[units[i]] = lv;
      }
    top_size[fam] = k;
    top_set[fam] = s;
    set_family[s] = fam;
    set_level[s] = lv;
  }
  for (int64_t t = 0; t < L; ++t) {
    f.row_family[t] = set_family[inv[t]];
    f.row_level[t] = set_level[inv[t]];
  }
  return f;
}

}  // namespace

CrossMask cross_mask(const at::Tensor& cross_attention_mask, int64_t tokens_per_tile,
                     const std::string& where) {
  const at::Tensor& m = cross_attention_mask;
  LVX_CHECK(m.defined() && m.dim() == 4 && !at::isFloatingType(m.scalar_type()) &&
                m.scalar_type() != at::kBool,
            where, ": cross_attention_mask must be an integer tensor [B, L, images, tiles], got ",
            m.defined() ? str(m.scalar_type(), " ", m.sizes()) : std::string("none"));
  const at::Tensor cam = m.cpu().to(at::kLong).contiguous();
  LVX_CHECK(((cam == 0) | (cam == 1)).all().item<bool>(), where,
            ": cross_attention_mask must hold 0 or 1");
  const int64_t B = cam.size(0), L = cam.size(1), I = cam.size(2), K = cam.size(3);
  LVX_CHECK(L >= 1, where, ": cross_attention_mask has no text rows (L = 0)");
  const int64_t U = I * K;
  const at::Tensor rows = cam.reshape({B, L, U}).to(at::kBool);
  CrossMask out;
  out.sees_media = rows.any(2);
  out.last_row_sees_media = out.sees_media.select(1, L - 1).contiguous();
  out.last_row_keys = at::where(out.last_row_sees_media.unsqueeze(1), rows.select(1, L - 1),
                                at::ones({B, U}, rows.options()))
                          .repeat_interleave(tokens_per_tile, 1)
                          .contiguous();
  if (I == 0) return out;
  std::vector<Families> fam;
  int32_t calls = 1;
  for (int64_t b = 0; b < B; ++b) {
    fam.push_back(families_of(rows[b].contiguous(), b, K, where));
    calls = std::max(calls, fam.back().count);
  }
  for (int32_t c = 0; c < calls; ++c) {
    const int32_t shift = c == 0 ? 1 : 0;
    at::Tensor q = at::empty({B, L}, at::kInt), kv = at::empty({B, U}, at::kInt);
    auto* qp = q.data_ptr<int32_t>();
    auto* kp = kv.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      const Families& f = fam[static_cast<size_t>(b)];
      for (int64_t t = 0; t < L; ++t) {
        const int32_t rf = f.row_family[t];
        qp[b * L + t] = rf == c ? f.row_level[t] + shift : c == 0 ? (rf < 0 ? -1 : 0) : -1;
      }
      for (int64_t u = 0; u < U; ++u)
        kp[b * U + u] = f.unit_family[u] == c ? f.unit_level[u] + shift : -1;
    }
    attention::MediaMask mm;
    mm.q_media = q;
    mm.kv_media = kv.repeat_interleave(tokens_per_tile, 1).contiguous();
    mm.rule = kernels::MediaRule::kUpTo;
    mm.unmatched_sees_all = c == 0;
    mm.slots = I;
    mm.tokens_per_media = K * tokens_per_tile;
    out.calls.push_back(mm);
  }
  return out;
}

at::Tensor cross_attention_mask_from_ids(const at::Tensor& input_ids, int64_t image_token_id,
                                         const at::Tensor& num_tiles, int64_t max_tiles,
                                         const std::string& where) {
  LVX_CHECK(input_ids.dim() == 2 && input_ids.scalar_type() == at::kLong, where,
            ": input_ids must be int64 [B, L], got ", input_ids.scalar_type(), " ",
            input_ids.sizes());
  const at::Tensor ids = input_ids.cpu().contiguous();
  const at::Tensor nt = num_tiles.cpu().to(at::kLong).contiguous();
  const int64_t B = ids.size(0), L = ids.size(1), I = nt.size(1);
  LVX_CHECK(nt.dim() == 2 && nt.size(0) == B, where, ": the images' tile counts must be [", B,
            ", images], got ", nt.sizes());
  at::Tensor cam = at::zeros({B, L, I, max_tiles}, at::kLong);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> loc;
    for (int64_t t = 0; t < L; ++t)
      if (ids[b][t].item<int64_t>() == image_token_id) loc.push_back(t);
    const int64_t n = static_cast<int64_t>(loc.size());
    LVX_CHECK(n <= I, where, ": sample ", b, " has ", n, " <|image|> tokens but the batch gives ",
              I, " images per sample");
    std::vector<int64_t> end(n);
    for (int64_t j = n - 1; j >= 0; --j)  // the next image, or the run's end for consecutive ones
      end[j] = j == n - 1 ? L : (loc[j + 1] == loc[j] + 1 ? end[j + 1] : loc[j + 1]);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t tiles = nt[b][j].item<int64_t>();
      LVX_CHECK(tiles >= 1 && tiles <= max_tiles, where, ": sample ", b, " image ", j, " has ",
                tiles, " real tiles, expected 1..", max_tiles, " (aspect_ratio_mask)");
      cam[b].narrow(0, loc[j], end[j] - loc[j]).select(1, j).narrow(1, 0, tiles).fill_(1);
    }
  }
  return cam;
}

}  // namespace lvx::models::mllama
