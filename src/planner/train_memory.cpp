#include "src/planner/train_memory.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "src/common/error.h"

namespace lvx::planner {

namespace {

// Parameters of one LM block (self entry): q/k/v/o projections with q/k/v biases, gated MLP,
// two norms.
int64_t block_parameters(const AttentionLayerConfig& l) {
  const int64_t h = l.hidden_size, q = l.heads * l.head_dim, kv = l.kv_heads * l.head_dim;
  return h * q + q + 2 * (h * kv + kv) + q * h + 3 * h * l.mlp_size + 2 * h;
}

// A cross layer's own parameters: K/V projections of the visual features and a norm.
int64_t cross_parameters(const AttentionLayerConfig& l, int64_t visual_dim) {
  const int64_t kv = l.kv_heads * l.head_dim;
  return visual_dim * 2 * kv + 2 * kv + 2 * visual_dim;
}

int64_t vision_parameters(const ModelConfig& m) {
  const auto& v = m.vision;
  if (v.hidden_size == 0) return 0;
  const int64_t h = v.hidden_size;
  const int64_t per_layer = 4 * h * h + 4 * h + 2 * h * v.mlp_size + v.mlp_size + h + 4 * h;
  const int64_t patches = v.patch_size > 0 ? (v.image_size / v.patch_size) : 0;
  return v.layers * per_layer + 3 * v.patch_size * v.patch_size * h + h + patches * patches * h;
}

std::string gib(double b) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", b / double(int64_t{1} << 30));
  return buf;
}

// What train_memory prices with: the world n, the sequence-parallel size S, the element bytes e,
// the parameters Ψ and trainable Ψt, and the units held whole or sharded.
struct TrainSizes {
  double n, S, e;
  bool lora;
  double psi, psi_t, block, root, frozen, frozen_max, b2;
};

// The world and element sizes, and the parameter counts of the run (a LoRA run trains its adapter).
TrainSizes train_sizes(const ModelConfig& m, const ParamCounts& pc, const TrainMemoryOptions& o) {
  const double n = static_cast<double>(o.ranks);
  const double S = static_cast<double>(o.sp_size > 0 ? o.sp_size : o.ranks);
  const double e = static_cast<double>(o.elem_bytes);
  const bool lora = o.lora_r > 0;
  const double psi = static_cast<double>(pc.total) + (lora ? lora_parameters(m, o.lora_r) : 0);
  const double psi_t =
      lora ? static_cast<double>(lora_parameters(m, o.lora_r)) : static_cast<double>(pc.trainable);
  // A LoRA adapter: every piece in the decoder layers (7 projections per block), none in the root.
  const double self_layers = std::max<double>(1, static_cast<double>(m.count(LayerKind::kSelf)));
  const double block = lora ? psi_t / self_layers : static_cast<double>(pc.max_block);
  const double root = lora ? 0 : static_cast<double>(pc.root);
  // The decoder layers' frozen parameters (stage 3 shards them too): all of a LoRA run's layers;
  // under a freeze policy what the layers hold beyond their trainable part.
  const double layers = static_cast<double>(pc.layers);
  const double frozen = lora ? layers : std::max(0.0, layers - (psi_t - root));
  const double frozen_max = lora ? static_cast<double>(pc.max_layer)
                                 : std::max(0.0, static_cast<double>(pc.max_layer) - block);
  // Whole at once in stages gradients and parameters: the root unit and two layers at most.
  const double b2 = std::max(0.0, std::min(2 * block, psi_t - root));
  return {n, S, e, lora, psi, psi_t, block, root, frozen, frozen_max, b2};
}

// The weights under shard policy s, pe bytes per trainable element as held.
double weight_bytes(const TrainSizes& z, double pe, const std::string& s) {
  return s == "parameters"
             ? z.e * (z.psi - z.psi_t - z.frozen) + pe * (z.root + z.b2) + z.e * z.frozen / z.n +
                   (z.frozen > 0 ? z.e * std::min(z.frozen, 2 * z.frozen_max) : 0)
             : z.e * (z.psi - z.psi_t) + pe * z.psi_t;
}

// The gradients' two moments: the reduction (g_reduce) and the update (g_update).
struct GradientBytes {
  double reduce, update;
};

// Gradients: the flat buffer the parameters' .grad view during the backward (e·Ψt; its fp32
// copy when e != 4), then the reduction and the update.
GradientBytes gradient_bytes(const TrainSizes& z, double pe, const TrainMemoryOptions& o) {
  const std::string& s = o.shard;
  const double convert = pe != 4 ? 4 * z.psi_t : 0;
  const double accumulate = o.grad_accum > 1 ? 4 * z.psi_t : 0;
  double g_reduce = 0, g_update = 0;
  if (s == "none") {
    g_reduce = pe * z.psi_t + convert + accumulate + (o.ranks > 1 ? 4 * z.psi_t / z.n : 0);
    g_update = 4 * z.psi_t;
  } else if (s == "optimizer") {
    g_reduce = pe * z.psi_t + convert + accumulate + 4 * z.psi_t / z.n;
    g_update = 4 * z.psi_t / z.n + pe * z.psi_t;
  } else {
    // Layer by layer (src/runtime/layer_sharding.h).
    g_reduce =
        pe * (z.root + z.b2) + (pe != 4 ? 4 * std::max(z.root, z.block) : 0) + 4 * z.psi_t / z.n;
    // The update: the gradient shard and AdamW's one shard-sized temporary (the denominator);
    // then stage 2 gathers the new values into the parameters a unit's run at a time (the
    // shard released first).
    g_update = std::max(8 * z.psi_t / z.n, s == "gradients" ? pe * std::max(z.root, z.block) : 0.0);
  }
  return {g_reduce, g_update};
}

// Activations saved for the backward, and the largest attention working set.
struct ActivationBytes {
  double saved, working;
};

// The decoder layers' saved activations and attention working sets, for l_rank text and v_rank
// visual tokens on this rank.
ActivationBytes layer_activations(const ModelConfig& m, const TrainSizes& z,
                                  const TrainMemoryOptions& o, double l_rank, double v_rank) {
  const double e = z.e;
  double saved = 0, working = 0;
  for (const auto& l : m.layers) {
    const double h = static_cast<double>(l.hidden_size), mlp = static_cast<double>(l.mlp_size);
    const double q = static_cast<double>(l.heads * l.head_dim);
    const double kv = static_cast<double>(l.kv_heads * l.head_dim);
    const double lse = static_cast<double>(l.heads) * 4;
    if (l.kind == LayerKind::kSelf) {
      saved += l_rank * (o.remat ? h * e : (4 * h + 4 * mlp) * e);
      saved += l_rank * ((q + 2 * kv + q) * e + lse);
      // Two K/V blocks in flight, the fp32 output and gradient accumulators of the queries.
      working = std::max(working, 2 * l_rank * 2 * kv * e + l_rank * (q * 4 + q * 4 + 2 * kv * 4));
    } else {
      saved += l_rank * (h * e + q * e + lse);
      if (!o.recompute) saved += v_rank * 2 * kv * e;
      working = std::max(working,
                         2 * v_rank * 2 * kv * e + l_rank * (q * 4 + q * 4) + v_rank * 2 * kv * 4);
    }
  }
  return {saved, working};
}

// Adds to *saved the activations saved beyond the layers: the logits' and LoRA's.
void add_head_and_lora_activations(const ModelConfig& m, const ParamCounts& pc, const TrainSizes& z,
                                   const TrainMemoryOptions& o, double l_rank, double* saved) {
  *saved += l_rank * (z.e + 8) * static_cast<double>(pc.vocab);  // logits, fp32 copy, log-softmax
  // LoRA on the activation path (models/lora.h): per adapted projection and token its x·Aᵀ (r
  // elements), and, in a compute dtype other than fp32, A and B cast to it (saved by the branch's
  // two products: the adapter once more, in e bytes).
  if (z.lora) {
    *saved += l_rank * z.e * static_cast<double>(o.lora_r) *
              static_cast<double>(kLoraProjectionsPerBlock * m.count(LayerKind::kSelf));
    if (z.e != 4) *saved += z.e * z.psi_t;
  }
}

// The visual features y of this rank's frames, and the vision tower's largest transient while
// it encodes them (hidden states in and out, the MLP's intermediate; frozen: nothing saved).
double visual_bytes(const ModelConfig& m, const TrainSizes& z, double v_rank) {
  return v_rank * static_cast<double>(m.visual_feature_dim) * z.e +
         v_rank * static_cast<double>(2 * m.vision.hidden_size + m.vision.mlp_size) * z.e;
}

}  // namespace

ParamCounts estimate_parameters(const ModelConfig& m, int64_t vocab_size,
                                const std::string& freeze) {
  ParamCounts p;
  int64_t blocks = 0, cross = 0, h = 0;
  for (const auto& l : m.layers) {
    h = std::max(h, l.hidden_size);
    if (l.kind == LayerKind::kSelf) {
      blocks += block_parameters(l);
      p.max_block = std::max(p.max_block, block_parameters(l));
    } else {
      cross += cross_parameters(l, m.visual_feature_dim);
    }
  }
  p.layers = blocks + cross;
  const int64_t vision = vision_parameters(m);
  // The projector from the vision width to the visual features (one linear layer).
  const int64_t projector = m.vision.hidden_size * m.visual_feature_dim + m.visual_feature_dim;
  const int64_t embeddings = 2 * vocab_size * h + h;  // input embeddings, untied head, final norm
  p.total = blocks + cross + vision + projector + embeddings;
  int64_t max_cross = 0;  // a decoder layer holds its block and, if it has one, its cross part
  for (const auto& l : m.layers)
    if (l.kind != LayerKind::kSelf)
      max_cross = std::max(max_cross, cross_parameters(l, m.visual_feature_dim));
  p.max_layer = p.max_block + max_cross;  // p.max_block: the largest block, before the policy
  if (freeze == "none") {
    p.trainable = p.total;
    p.root = vision + projector + embeddings;
    p.max_block += max_cross;
  } else if (freeze == "cross_only") {
    p.trainable = cross;
    p.max_block = max_cross;
  } else {
    p.trainable = p.total - vision;
    p.root = projector + embeddings;
    p.max_block += max_cross;
  }
  p.vocab = vocab_size;
  return p;
}

int64_t lora_parameters(const ModelConfig& m, int64_t r) {
  int64_t n = 0;
  for (const auto& l : m.layers) {
    if (l.kind != LayerKind::kSelf) continue;
    const int64_t h = l.hidden_size, q = l.heads * l.head_dim, kv = l.kv_heads * l.head_dim;
    n += r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + l.mlp_size) + (l.mlp_size + h));
  }
  return n;
}

TrainMemory train_memory(const ModelConfig& m, const ParamCounts& pc, int64_t frames,
                         int64_t text_tokens, int64_t tokens_per_frame, const TrainMemoryOptions& o,
                         double device_bytes) {
  LVX_CHECK(o.ranks >= 1, "train memory: ranks must be >= 1, got ", o.ranks);
  const TrainSizes z = train_sizes(m, pc, o);
  const std::string& s = o.shard;
  LVX_CHECK(s == "none" || s == "optimizer" || s == "gradients" || s == "parameters",
            "--shard: expected none | optimizer | gradients | parameters, got '", s, "'");
  const bool sharded = s != "none";
  TrainMemory t;
  t.device = device_bytes;
  // Weights and optimizer state (a LoRA adapter is fp32 beside the frozen base).
  const double pe = z.lora ? 4 : z.e;  // bytes per trainable element as held
  t.weights = weight_bytes(z, pe, s);
  t.optimizer = 12 * z.psi_t / (sharded ? z.n : 1);
  const GradientBytes g = gradient_bytes(z, pe, o);
  // Activations saved for the backward (this rank's L/S text tokens).
  const double l_rank = static_cast<double>(text_tokens) / z.S;
  const double v_rank = static_cast<double>(frames) * static_cast<double>(tokens_per_frame) / z.S;
  ActivationBytes a = layer_activations(m, z, o, l_rank, v_rank);
  add_head_and_lora_activations(m, pc, z, o, l_rank, &a.saved);
  t.activations = a.saved;
  t.attention = a.working;
  t.visual = visual_bytes(m, z, v_rank);
  t.gradients = std::max(g.reduce, g.update);
  // Activation memory freed in the backward stays with the allocator (glibc's heap on the CPU,
  // the caching allocator on a GPU), so it adds to the gradients' largest moment.
  t.total = t.weights + t.optimizer + t.activations + t.attention + t.visual + t.gradients;
  t.reserve = o.reserve_bytes >= 0 ? o.reserve_bytes : default_reserve_bytes(device_bytes);
  t.fits = device_bytes <= 0 || t.total <= device_bytes - t.reserve;
  return t;
}

double default_reserve_bytes(double device_bytes) {
  return device_bytes > 0 ? 1.5 * double(int64_t{1} << 30) + 0.08 * device_bytes : 0;
}

nlohmann::json to_json(const TrainMemory& t) {
  return {{"weights_bytes", t.weights},     {"gradients_bytes", t.gradients},
          {"optimizer_bytes", t.optimizer}, {"activations_bytes", t.activations},
          {"attention_bytes", t.attention}, {"visual_bytes", t.visual},
          {"peak_bytes", t.total},          {"device_bytes", t.device},
          {"reserve_bytes", t.reserve},     {"fits", t.fits}};
}

std::string format_memory(const TrainMemory& t) {
  std::ostringstream os;
  os << "memory per rank: weights " << gib(t.weights) << ", gradients " << gib(t.gradients)
     << " (at their largest), optimizer state " << gib(t.optimizer) << ", saved activations "
     << gib(t.activations) << ", attention working set " << gib(t.attention) << ", visual features "
     << gib(t.visual) << "; peak " << gib(t.total);
  if (t.device > 0)
    os << " of " << gib(t.device) << " less " << gib(t.reserve) << " reserved"
       << (t.fits ? " (fits)" : " (DOES NOT FIT)");
  os << "\n";
  return os.str();
}

}  // namespace lvx::planner
