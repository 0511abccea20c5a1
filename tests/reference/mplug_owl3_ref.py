"""Independent PyTorch reference for lvx's mPLUG-Owl3 model (conformance tests of the C++ runtime).

One file on purpose: the C++ tests cache what it generates keyed by its content (script_stamp in
tests/model_conformance.h reads only this script and requirements.txt / requirements-nodeps.txt),
so everything that shapes the expected values stays in this one file, the only source file in
the key.

usage:
  mplug_owl3_ref.py make-model OUT_DIR --variant 240728|241101 [--seed S] [--shards N] [--dtype fp32|bf16]
  mplug_owl3_ref.py make-batch OUT_DIR BATCH.safetensors [--seed S] [--batch B] [--length L]
                               [--images-per-sample 2,3] [--layout video_qa|interleaved]
  mplug_owl3_ref.py run OUT_DIR BATCH.safetensors EXPECTED.safetensors [--backward]
                        [--variant auto|240728|241101] [--intermediates]
  mplug_owl3_ref.py generate OUT_DIR BATCH.safetensors EXPECTED.safetensors --tokens N
  mplug_owl3_ref.py selfcheck [--workdir DIR]

make-model writes a TINY random checkpoint directory in the released Hugging Face layout:
config.json (model_type "mplugowl3", hyper_layers 1-based, vision_config), model.safetensors or
model-0000i-of-0000N.safetensors + model.safetensors.index.json, tokenizer.json (byte-level BPE,
Qwen2-style pipeline, added special tokens <|endoftext|> <|im_start|> <|im_end|> <|image|>).
Sizes: LM hidden 64, 4 layers (hyper_layers [2, 4] -> 0-based 1, 3), 4 heads, 2 KV heads (head_dim
16), MLP 96, vocab 320 (tokenizer ~304 ids), rope_theta 1e6; SigLIP hidden 32, 3 layers, 2 heads,
MLP 48, patch 8, image 32 -> 16 tokens per image. Same seed -> same weights for any --shards.

make-batch writes BATCH.safetensors: input_ids int64 [B, L] (with <|image|> tokens), pixel_values
float32 [N_img, 3, S, S] (all images of the batch in prompt order: sample 0's, then sample 1's, ...),
labels int64 [B, L] (-100 = ignore; NOT shifted: position t's logits predict labels[t]).

run writes EXPECTED.safetensors: logits float32 [B, L, vocab_size]; with --backward also loss
(float32, 0-dim: mean cross-entropy over labels != -100) and grad.<param> float32 for EVERY tensor
of the checkpoint (zeros for the ones the forward does not use: the last SigLIP layer,
post_layernorm, head, and v_kv_proj/gate when no image is visible). With --intermediates also
vision_features [N_img, T, Dv] (hidden_states[-2]), image_embeds [N_img, T, H] (projector output),
and per decoder layer i: attn_input.<i> [B, L, H] (input_layernorm output), ctx.<i> [B, L, H]
(attention output before o_proj, heads concatenated; in hyper layers after the cross-attention /
gate / fused softmax) and hidden.<i> [B, L, H] (layer output, before the final norm).
The variant is read off the checkpoint (self_attn.gate present -> 240728, else 241101) unless
--variant says otherwise.

generate writes EXPECTED.safetensors: tokens int64 [B, N] and step_logits float32 [B, N, V], greedy
decoding WITHOUT a cache: step t runs the whole forward on the prompt plus the t tokens chosen so
far and takes the argmax (lowest id on ties) of the last position's logits (fp64). A new token sees
every image of its sample (it comes after every <|image|>), under both variants' rules as written.

selfcheck builds both variants with --shards 1 and 3 (B=2, both layouts) in a temporary directory
and checks: shards 1 == 3; a bf16 checkpoint loads; text-only logits == transformers'
Qwen2ForCausalLM (the run subcommand checks this too, on every batch, and exits non-zero if it
fails); masks and MI-RoPE positions == the verbatim transcriptions in media_mask_ref.py and
§1.6's formula; the hyper-layer attention == a second, differently written implementation (SDPA,
einops split, complex RoPE); projector == nn.Sequential(Linear, nn.GELU(), Linear); v_kv_proj
split == §1.5's einops pattern; shared LayerNorm (image_embeds scale does not matter); finite
differences == autograd; unused vision tensors get zero gradient, used ones non-zero; tokenizer
determinism; an edge batch (sample without images, only image at L-1, images at 0 and 1); and the
sensitivity of the logits to (a) the gate (240728), (b) v_kv_proj, (c) one image's pixels (exactly
the tokens after that image's token change for 240728, from the token on for 241101, nothing in
the other sample), (d) the MI-RoPE position (same rows). Exits non-zero on any failure.

PRECISION. Everything is computed in float64 (checkpoint read as stored, converted to fp32, then to
fp64; pixel_values likewise), outputs are written as float32. Exceptions, on purpose: the RoPE
cos/sin tables (text RoPE and MI-RoPE) are computed in fp32 exactly as transformers' Qwen2 and the
released RotaryEmbedding(use_fp32=True) compute them (inv_freq = 1 / theta ** (arange(0, D, 2) / D)
in fp32, angle = float(pos) * inv_freq in fp32, cos/sin in fp32) and only then widened to fp64;
the rotation itself is fp64. (The release additionally casts MI-RoPE'd keys to fp32 and back; in
fp64 that is not done.) SigLIP runs as transformers' SiglipVisionModel with attn_implementation
"sdpa" (its "eager" path takes the softmax in fp32).

The forward is written from ../shared/reference/models.md §1 (not from any lvx code). Where it
follows the spec:
 * §1.1  hyper layers are (layer_idx + 1) in config.hyper_layers; config fields as released.
 * §1.2  vision = SiglipVisionModel(pixel_values, output_hidden_states=True).hidden_states[-2]
         (the last encoder layer, post_layernorm and head are in the checkpoint and unused).
         SigLIP hidden_act / layer_norm_eps are the SiglipVisionConfig defaults
         (gelu_pytorch_tanh, 1e-6) because the released vision_config does not set them.
 * §1.3  projector vision2text_model = Linear(Dv, H), nn.GELU() (EXACT erf GELU), Linear(H, H).
 * §1.4  Qwen2 layers: RMSNorm, q/k/v with bias, o_proj without, GQA (repeat_kv =
         repeat_interleave over heads), RoPE at position_ids = arange(L), SwiGLU MLP; final norm;
         lm_head (tie_word_embeddings false). Shared LayerNorm: in a hyper layer the image embeds
         go through the SAME input_layernorm weights as the text.
 * §1.5  240728: ctx_self = causal self-attention (before o_proj); kv = v_kv_proj(v) split
         head-major (channel = h*(2*D) + kv*D + d: per KV head a K block then a V block); queries
         are the self-attention q after text RoPE; keys MI-RoPE'd, values not; scale 1/sqrt(D);
         token t sees images j < count(t), count(t) = #<|image|> at positions < t; rows with
         count(t) == 0 keep ctx_self (no gate); else ctx = ctx_self*(1-g) + ctx_cross*g,
         g = sigmoid(gate) per hidden channel (heads concatenated); then o_proj.
 * §1.6  MI-RoPE: one scalar position per image for all its keys, rotate-half form, same theta,
         separate fp32 table; p_j = index of image j's <|image|> + 1 (240728), = index (241101).
 * §1.7  241101: no gate; one softmax over [visual keys | text keys], mask [t2v | causal],
         t2v[t, j] = t >= media_starts[j]; samples without images: plain causal.
 * §1.8  sample b's images are pixel_values[sum_{b'<b} n_b' : ... + n_b] (the batch-wide
         media_offset of ms-swift's collation / the 241101 image_start running index).
Checked against the Paddle transcriptions [S2] (240728 crossattention / apply_mi_rope /
make_t2v_mask) and [S1] (241101 hyperattention) while writing this file.

GUESSES / decisions (where the spec is silent or the release would misbehave):
 G1 240728, a sample whose only images sit at the last position (no token after any image): the
    released select_query/`nonzero()[0]` raises IndexError; here that sample is pure
    self-attention (no row sees an image). An image at position L-1 next to earlier images is
    simply never visible (the release drops it from K/V: hi = count(L-1)); here its keys are
    present but masked for every row -> identical outputs, zero gradient through it.
 G2 Variant is not in config.json (the releases differ only in weights/sizes): detected from
    the presence of `self_attn.gate` keys.
 G3 config.json: the released fields only (no vision_batch_size, no top-level image_size /
    patch_size, no hidden_act/layer_norm_eps in vision_config); transformers_version says what
    wrote it (4.57.3), not 4.41.2.
 G4 Tiny tokenizer: Qwen2-style pipeline (NFC normalizer, Split(Qwen2 pretokenize regex,
    Isolated) + ByteLevel(use_regex=false), ByteLevel post-processor and decoder with
    add_prefix_space/trim_offsets/use_regex false), BPE (256 byte symbols + ~44 merges, vocab 300)
    trained on a built-in corpus;
    the four special tokens are added AFTER training (ids at the end, as in Qwen2), special=true,
    normalized=false. config bos = <|endoftext|>, eos = <|im_end|> ids of this tokenizer.
 G5 Weights are NOT transformers' init (std 0.02 makes every activation vanish): each tensor is
    drawn from a dedicated torch.Generator(seed) in key order: matrices N(0, 1/fan_in), biases
    N(0, 0.1^2), norm weights 1 + N(0, 0.1^2), LayerNorm biases N(0, 0.1^2), embeddings N(0, 1),
    position embeddings N(0, 0.5^2), gate N(0, 1) (the release initialises it to zeros).
 G6 Labels: not shifted (the caller shifts); loss = mean CE over labels != -100 (logits in fp64).
 G7 Key order in shards: vision_model.*, vision2text_model.*, language_model.* (module order),
    split greedily into N shards of ~equal bytes; safetensors metadata {"format": "pt"}.
 G8 No padding / attention_mask: every sample is L real tokens, position_ids = arange(L). (With left
    padding the release would still use raw sequence indexes for MI-RoPE, §1.6; not modelled.)
 G9 make-batch prompts are random ordinary token ids (no chat template) plus <|image|> tokens.
    video_qa: sample b's n_b images at positions 2+b .. 2+b+n_b-1. interleaved: sample 0's images
    spread over [0, L-6] (an image at position 0), the last sample's (B >= 2) over [3, L-1] (an
    image at L-1: never visible for 240728, sees only row L-1 for 241101), others over [5, L-5];
    one image: position 0 for sample 0, L/2 otherwise. --images-per-sample is cycled over the
    samples (0 allowed). labels: random ordinary ids, -100 at position 0, at <|image|> tokens and
    at ~25% of the rest. pixel_values uniform in [-1, 1].
"""
import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>"]
IMAGE_TOKEN = "<|image|>"
# transformers models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX (models.md §4)
QWEN2_PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "The video shows a man riding a bicycle along the river at sunset.",
    "What is the woman holding in her left hand? She is holding a red umbrella.",
    "Describe the scene: two dogs play with a ball on the green grass.",
    "How many people are in the room? There are three people sitting at the table.",
    "The camera pans from the mountains to the lake, where a small boat is floating.",
    "A child opens the door and runs into the garden to catch the cat.",
    "In the first frame the car is parked; in the last frame it drives away.",
    "Question: what happens after the bell rings? Answer: the students leave the class.",
    "The chef cuts the onions, adds them to the pan and stirs for 5 minutes.",
    "Summarize the video in one sentence. A cooking show about making pasta at home.",
    "Is it raining in the video? No, the sky is clear and the sun is shining.",
    "The player kicks the ball, the goalkeeper jumps, and the crowd cheers loudly.",
    "Where does the story take place? It takes place in a busy train station in 1999.",
    "user: look at these frames and tell me what changed between them.",
    "assistant: the light turned green and the people started to cross the street.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 2024 and symbols ( ) [ ] { } , . ; : ! ? - _ / \\ \" ' @ #",
    "Ünïcödé wörds: café, naïve, façade; 中文 视频 图像; emoji-free text with tabs\tand\nnewlines.",
]


# ---------------------------------------------------------------------------------------------
# configuration and checkpoint writing
# ---------------------------------------------------------------------------------------------
def tiny_config(variant, dtype, bos_id, eos_id):
    return {
        "architectures": ["mPLUGOwl3Model"],
        "auto_map": {
            "AutoConfig": "configuration_mplugowl3.mPLUGOwl3Config",
            "AutoModel": "modeling_mplugowl3.mPLUGOwl3Model",
            "AutoModelForCausalLM": "modeling_mplugowl3.mPLUGOwl3Model",
        },
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "hidden_size": 64,
        "hyper_layers": [2, 4],
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 32768,
        "max_window_layers": 4,
        "model_type": "mplugowl3",
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
        "transformers_version": "4.57.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "hidden_size": 32,
            "image_size": 32,
            "intermediate_size": 48,
            "model_type": "siglip_vision_model",
            "num_attention_heads": 2,
            "num_hidden_layers": 3,
            "patch_size": 8,
        },
        "vocab_size": 320,
    }


def build_tokenizer():
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors,
                            trainers)
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=300, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def state_dict_template(cfg, variant):
    """Key names and shapes from the transformers modules themselves (plus the mPLUG-Owl3 extras)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, SiglipVisionConfig, SiglipVisionModel
    torch.manual_seed(0)  # module construction draws random numbers; the values are replaced below
    vision = SiglipVisionModel(SiglipVisionConfig(**vision_config_kwargs(cfg)))
    lm = Qwen2ForCausalLM(qwen2_config(cfg))
    H, Dv = cfg["hidden_size"], cfg["vision_config"]["hidden_size"]
    D = H // cfg["num_attention_heads"]
    shapes = {k: tuple(v.shape) for k, v in vision.state_dict().items()}  # keys start with vision_model.
    shapes.update({"vision2text_model.0.weight": (H, Dv), "vision2text_model.0.bias": (H,),
                   "vision2text_model.2.weight": (H, H), "vision2text_model.2.bias": (H,)})
    for k, v in lm.state_dict().items():
        shapes["language_model." + k] = tuple(v.shape)
        if k.endswith("self_attn.o_proj.weight"):
            i = int(k.split(".")[2])
            if i + 1 in cfg["hyper_layers"]:
                pre = f"language_model.model.layers.{i}.self_attn."
                shapes[pre + "v_kv_proj.weight"] = (2 * cfg["num_key_value_heads"] * D, H)
                shapes[pre + "v_kv_proj.bias"] = (2 * cfg["num_key_value_heads"] * D,)
                if variant == "240728":
                    shapes[pre + "gate"] = (H,)
    return shapes


def init_tensor(name, shape, gen):
    leaf = name.split(".")[-1]
    if leaf == "gate":
        return torch.randn(shape, generator=gen)
    if "norm" in name and leaf == "weight":  # RMSNorm / LayerNorm scales
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if leaf in ("bias", "in_proj_bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight") or leaf == "probe":
        return torch.randn(shape, generator=gen)
    if name.endswith("position_embedding.weight"):
        return 0.5 * torch.randn(shape, generator=gen)
    fan_in = math.prod(shape[1:])  # Linear [out, in], Conv2d [out, in, kh, kw]
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def cmd_make_model(args):
    out = args.out_dir
    os.makedirs(out, exist_ok=True)
    tok = build_tokenizer()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    cfg = tiny_config(args.variant, args.dtype, ids["<|endoftext|>"], ids["<|im_end|>"])
    assert tok.get_vocab_size() <= cfg["vocab_size"], (tok.get_vocab_size(), cfg["vocab_size"])
    shapes = state_dict_template(cfg, args.variant)
    gen = torch.Generator().manual_seed(args.seed)
    sd = {k: init_tensor(k, s, gen) for k, s in sorted(shapes.items())}
    order = ([k for k in shapes if k.startswith("vision_model.")] + [k for k in shapes if k.startswith("vision2text_model.")]
             + [k for k in shapes if k.startswith("language_model.")])
    assert len(order) == len(sd)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    sd = {k: sd[k].to(dt).contiguous() for k in order}
    for f in os.listdir(out):  # a previous checkpoint with another shard count must not linger
        if f.startswith("model") and (f.endswith(".safetensors") or f.endswith(".index.json")):
            os.remove(os.path.join(out, f))
    n = max(1, args.shards)
    if n == 1:
        save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        nbytes = {k: v.numel() * v.element_size() for k, v in sd.items()}
        total = sum(nbytes.values())
        groups, acc = [[] for _ in range(n)], 0
        for k in order:  # greedy, ~equal bytes, every shard non-empty
            g = min(n - 1, acc * n // total)
            g = max(g, n - (len(order) - order.index(k)))  # leave at least one key per later shard
            groups[g].append(k)
            acc += nbytes[k]
        assert all(groups), [len(g) for g in groups]
        weight_map = {}
        for i, g in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file({k: sd[k] for k in g}, os.path.join(out, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in g})
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tok.save(os.path.join(out, "tokenizer.json"))
    print(f"wrote {out}: variant {args.variant}, {len(sd)} tensors in {n} file(s), {args.dtype}, "
          f"tokenizer {tok.get_vocab_size()} ids (<|image|> = {ids[IMAGE_TOKEN]}), config vocab {cfg['vocab_size']}")


# ---------------------------------------------------------------------------------------------
# checkpoint reading
# ---------------------------------------------------------------------------------------------
def vision_config_kwargs(cfg):
    vc = dict(cfg["vision_config"])
    vc.pop("model_type", None)
    return vc


def qwen2_config(cfg):
    from transformers import Qwen2Config
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
            "use_cache", "tie_word_embeddings", "rope_theta", "use_sliding_window", "sliding_window",
            "max_window_layers", "attention_dropout", "bos_token_id", "eos_token_id"]
    return Qwen2Config(**{k: cfg[k] for k in keys if k in cfg})


def read_tokenizer_ids(model_dir):
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tj = json.load(f)
    added = {t["content"]: t["id"] for t in tj["added_tokens"]}
    return added, len(tj["model"]["vocab"])


def load_checkpoint(model_dir):
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    sd = {}
    if os.path.exists(idx):
        with open(idx) as f:
            index = json.load(f)
        total = 0
        for fname in sorted(set(index["weight_map"].values())):
            part = load_file(os.path.join(model_dir, fname))
            for k, v in part.items():
                assert index["weight_map"].get(k) == fname, f"{k} in {fname} but index says {index['weight_map'].get(k)}"
                assert k not in sd, f"duplicate key {k}"
                total += v.numel() * v.element_size()
                sd[k] = v
        assert set(sd) == set(index["weight_map"]), "index names tensors that no shard holds"
        assert total == index["metadata"]["total_size"], (total, index["metadata"]["total_size"])
    else:
        sd = load_file(os.path.join(model_dir, "model.safetensors"))
    return {k: v.float() for k, v in sd.items()}  # read as stored, widened to fp32


class Model:
    """Checkpoint -> float64 tensors. `W` holds language_model.* and vision2text_model.* as leaf tensors;
    the vision tower is transformers' SiglipVisionModel holding the vision_model.* tensors."""

    def __init__(self, model_dir, variant="auto"):
        from transformers import SiglipVisionConfig, SiglipVisionModel
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = cfg = json.load(f)
        assert cfg["model_type"] == "mplugowl3", cfg["model_type"]
        sd = load_checkpoint(model_dir)
        head, embed = "language_model.lm_head.weight", "language_model.model.embed_tokens.weight"
        tied = bool(cfg.get("tie_word_embeddings")) and head not in sd  # the 1B and 2B ship no head
        if tied:
            sd[head] = sd[embed]
        has_gate = any(k.endswith("self_attn.gate") for k in sd)
        self.variant = ("240728" if has_gate else "241101") if variant == "auto" else variant
        if (self.variant == "240728") != has_gate:
            sys.exit(f"--variant {self.variant} does not match the checkpoint ({'has' if has_gate else 'no'} self_attn.gate)")
        self.H = cfg["hidden_size"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.D = self.H // self.nh
        self.L = cfg["num_hidden_layers"]
        self.eps = cfg["rms_norm_eps"]
        self.theta = float(cfg["rope_theta"])
        self.hyper = [i for i in range(self.L) if i + 1 in cfg["hyper_layers"]]  # §1.1: 1-based in config
        added, _ = read_tokenizer_ids(model_dir)
        self.image_id = added[IMAGE_TOKEN]

        expected = state_dict_template(cfg, self.variant)
        optional = {k for k in expected if k.startswith(("vision_model.head.", "vision_model.post_layernorm."))}
        missing = set(expected) - set(sd) - optional
        unexpected = set(sd) - set(expected)
        assert not missing and not unexpected, f"missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        for k, v in sd.items():
            assert tuple(v.shape) == expected[k], (k, tuple(v.shape), expected[k])

        vcfg = SiglipVisionConfig(**vision_config_kwargs(cfg))
        vcfg._attn_implementation = "sdpa"  # fp64 softmax (its eager path takes the softmax in fp32)
        self.vision = SiglipVisionModel(vcfg).to(torch.float64).eval()
        vsd = {k: v.double() for k, v in sd.items() if k.startswith("vision_model.")}
        res = self.vision.load_state_dict(vsd, strict=False)
        assert not res.unexpected_keys and set(res.missing_keys) <= optional, res
        self.W = {k: v.double().requires_grad_(True) for k, v in sd.items() if not k.startswith("vision_model.")}
        if tied:  # one tensor under both names, as Qwen2ForCausalLM ties them
            self.W[head] = self.W[embed]
        self.sd_keys = [k for k in sd if not (tied and k == head)]

    # -- names -------------------------------------------------------------------------------
    def lw(self, i, name):
        return self.W[f"language_model.model.layers.{i}.{name}"]

    def parameters(self):
        named = dict(self.W)
        named.update({n: p for n, p in self.vision.named_parameters() if n in self.sd_keys})
        return named


# ---------------------------------------------------------------------------------------------
# the forward (from models.md §1)
# ---------------------------------------------------------------------------------------------
def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_cos_sin(pos, D, theta):
    """fp32 table as transformers' Qwen2RotaryEmbedding and the release's RotaryEmbedding(use_fp32=True)
    compute it; widened to fp64. pos: int64 tensor of any shape -> [..., D]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    ang = pos.float()[..., None] * inv_freq
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().double(), emb.sin().double()


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def attend(q, k, v, allow):
    """q [h, Lq, D], k/v [h, Lk, D], allow [Lq, Lk] bool (True = attend). Scale 1/sqrt(D)."""
    assert bool(allow.any(-1).all()), "a query row sees no key"
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allow, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def media_positions(ids_b, image_id):
    return (ids_b == image_id).nonzero().flatten()


def image_visibility(L, starts, T, variant):
    """[L, n*T] bool: text token t attends to visual key (image j, token k). 240728: j < count(t),
    count(t) = #<|image|> at positions < t. 241101: t >= starts[j]."""
    t = torch.arange(L)[:, None]
    if variant == "240728":
        count = (t > starts[None, :]).sum(1, keepdim=True)  # [L, 1]
        vis = torch.arange(len(starts))[None, :] < count
    else:
        vis = t >= starts[None, :]
    return vis.repeat_interleave(T, dim=1)


def split_visual_kv(kv, nkv, D):
    """v_kv_proj output [N, 2*nkv*D] -> K, V [nkv, N, D]; head-major: channel = h*(2*D) + kv*D + d."""
    kv = kv.view(kv.shape[0], nkv, 2, D)
    return kv[:, :, 0].transpose(0, 1), kv[:, :, 1].transpose(0, 1)


def mi_rope_positions(starts, variant):
    return starts + 1 if variant == "240728" else starts


def vision_forward(m, pixel_values):
    out = m.vision(pixel_values=pixel_values, output_hidden_states=True)
    feats = out.hidden_states[-2]  # §1.2
    W = m.W
    x = F.linear(feats, W["vision2text_model.0.weight"], W["vision2text_model.0.bias"])
    x = F.gelu(x)  # nn.GELU() default: exact erf
    x = F.linear(x, W["vision2text_model.2.weight"], W["vision2text_model.2.bias"])
    return feats, x


def forward(m, input_ids, pixel_values, use_images=True, mi_rope_delta=None, inter=None):
    """input_ids [B, L] int64, pixel_values [N_img, 3, S, S] float64 -> logits [B, L, V] float64.
    mi_rope_delta: optional int64 [N_img] added to every image's MI-RoPE position (sensitivity test).
    use_images=False: no visual path anywhere (must equal plain Qwen2)."""
    B, L = input_ids.shape
    H, nh, nkv, D, eps = m.H, m.nh, m.nkv, m.D, m.eps
    rep = nh // nkv
    starts = [media_positions(input_ids[b], m.image_id) for b in range(B)]
    counts = [len(s) for s in starts]
    first = [sum(counts[:b]) for b in range(B)]
    image_embeds = None
    if use_images and sum(counts) > 0:
        assert pixel_values.shape[0] == sum(counts), (pixel_values.shape, counts)
        feats, image_embeds = vision_forward(m, pixel_values)
        if inter is not None:
            inter["vision_features"], inter["image_embeds"] = feats, image_embeds
    else:
        assert not use_images or pixel_values is None or pixel_values.shape[0] == 0, "images without <|image|> tokens"
    T = image_embeds.shape[1] if image_embeds is not None else 0

    W = m.W
    h = F.embedding(input_ids, W["language_model.model.embed_tokens.weight"])
    cos, sin = rope_cos_sin(torch.arange(L), D, m.theta)  # position_ids = arange(L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    for i in range(m.L):
        x = rms_norm(h, m.lw(i, "input_layernorm.weight"), eps)
        q = F.linear(x, m.lw(i, "self_attn.q_proj.weight"), m.lw(i, "self_attn.q_proj.bias"))
        k = F.linear(x, m.lw(i, "self_attn.k_proj.weight"), m.lw(i, "self_attn.k_proj.bias"))
        v = F.linear(x, m.lw(i, "self_attn.v_proj.weight"), m.lw(i, "self_attn.v_proj.bias"))
        q = apply_rope(q.view(B, L, nh, D).transpose(1, 2), cos, sin)  # [B, nh, L, D], after text RoPE
        k = apply_rope(k.view(B, L, nkv, D).transpose(1, 2), cos, sin)
        v = v.view(B, L, nkv, D).transpose(1, 2)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # repeat_kv
        hyper = i in m.hyper and image_embeds is not None
        ctxs = []
        for b in range(B):
            if not hyper or counts[b] == 0:
                ctx = attend(q[b], k[b], v[b], causal)
                ctxs.append(ctx.transpose(0, 1).reshape(L, H))
                continue
            n = counts[b]
            img = image_embeds[first[b]: first[b] + n].reshape(n * T, H)
            img = rms_norm(img, m.lw(i, "input_layernorm.weight"), eps)  # shared LayerNorm
            kv = F.linear(img, m.lw(i, "self_attn.v_kv_proj.weight"), m.lw(i, "self_attn.v_kv_proj.bias"))
            vk, vv = split_visual_kv(kv, nkv, D)  # [nkv, n*T, D] each
            p = mi_rope_positions(starts[b], m.variant)
            if mi_rope_delta is not None:
                p = p + mi_rope_delta[first[b]: first[b] + n]
            vcos, vsin = rope_cos_sin(p.repeat_interleave(T), D, m.theta)  # one position per image
            vk = apply_rope(vk, vcos, vsin)  # values stay unrotated
            vk, vv = vk.repeat_interleave(rep, dim=0), vv.repeat_interleave(rep, dim=0)
            vis = image_visibility(L, starts[b], T, m.variant)
            if m.variant == "240728":
                ctx_self = attend(q[b], k[b], v[b], causal).transpose(0, 1).reshape(L, H)
                rows = vis.any(-1)  # count(t) > 0
                if not bool(rows.any()):  # G1: only images at the last position
                    ctxs.append(ctx_self)
                    continue
                ctx_cross = attend(q[b][:, rows], vk, vv, vis[rows]).transpose(0, 1).reshape(-1, H)
                g = torch.sigmoid(m.lw(i, "self_attn.gate"))
                mixed = torch.zeros_like(ctx_self).index_put((rows.nonzero().flatten(),), ctx_cross * g)
                ctxs.append(torch.where(rows[:, None], ctx_self * (1 - g) + mixed, ctx_self))
            else:
                kk = torch.cat([vk, k[b]], dim=1)
                vvv = torch.cat([vv, v[b]], dim=1)
                ctx = attend(q[b], kk, vvv, torch.cat([vis, causal], dim=1))
                ctxs.append(ctx.transpose(0, 1).reshape(L, H))
        ctx = torch.stack(ctxs)
        if inter is not None:
            inter[f"attn_input.{i}"], inter[f"ctx.{i}"] = x, ctx
        h = h + F.linear(ctx, m.lw(i, "self_attn.o_proj.weight"))
        x = rms_norm(h, m.lw(i, "post_attention_layernorm.weight"), eps)
        gate = F.linear(x, m.lw(i, "mlp.gate_proj.weight"))
        up = F.linear(x, m.lw(i, "mlp.up_proj.weight"))
        h = h + F.linear(F.silu(gate) * up, m.lw(i, "mlp.down_proj.weight"))
        if inter is not None:
            inter[f"hidden.{i}"] = h
    h = rms_norm(h, W["language_model.model.norm.weight"], eps)
    return F.linear(h, W["language_model.lm_head.weight"])


def loss_fn(logits, labels):
    assert bool((labels != -100).any()), "no label to train on"
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def text_only_check(m, input_ids, tight=True):
    """Our code with the visual path off == transformers' Qwen2ForCausalLM on the same weights."""
    from transformers import Qwen2ForCausalLM
    from transformers.models.qwen2 import modeling_qwen2
    qcfg = qwen2_config(m.cfg)
    qcfg._attn_implementation = "sdpa"
    lm = Qwen2ForCausalLM(qcfg).to(torch.float64).eval()
    lsd = {k[len("language_model."):]: v.detach() for k, v in m.W.items()
           if k.startswith("language_model.") and not k.endswith(("v_kv_proj.weight", "v_kv_proj.bias", "self_attn.gate"))}
    lm.load_state_dict(lsd, strict=True)
    with torch.no_grad():
        ours = forward(m, input_ids, None, use_images=False)
        theirs = lm(input_ids=input_ids).logits  # Qwen2RMSNorm computes in fp32: fp32-level agreement
        err32 = (ours - theirs).abs().max().item()
        err64 = None
        if tight:  # same model with its RMSNorm computed in fp64: agreement to fp64 rounding
            def fwd64(self, x):
                return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
            orig = modeling_qwen2.Qwen2RMSNorm.forward
            modeling_qwen2.Qwen2RMSNorm.forward = fwd64
            try:
                err64 = (ours - lm(input_ids=input_ids).logits).abs().max().item()
            finally:
                modeling_qwen2.Qwen2RMSNorm.forward = orig
    scale = ours.abs().max().item()
    ok = err32 <= 1e-4 * max(1.0, scale) and (err64 is None or err64 <= 1e-9 * max(1.0, scale))
    return ok, err32, err64, scale


# ---------------------------------------------------------------------------------------------
# batch
# ---------------------------------------------------------------------------------------------
def cmd_make_batch(args):
    added, n_model = read_tokenizer_ids(args.out_dir)
    with open(os.path.join(args.out_dir, "config.json")) as f:
        cfg = json.load(f)
    image_id = added[IMAGE_TOKEN]
    S = cfg["vision_config"]["image_size"]
    special = set(added.values())
    ordinary = torch.tensor([t for t in range(n_model) if t not in special])
    gen = torch.Generator().manual_seed(args.seed)
    per = [int(x) for x in args.images_per_sample.split(",")]
    B, L = args.batch, args.length
    ids = ordinary[torch.randint(len(ordinary), (B, L), generator=gen)]
    for b in range(B):
        n = per[b % len(per)]
        if n == 0:
            continue
        if args.layout == "video_qa":  # system/user text, then all frames, then the question
            s = 2 + b
            pos = list(range(s, s + n))
        else:  # interleaved: spread over the prompt. Sample 0 starts with an image at position 0; the
            # last sample of a batch of >= 2 ends with one at L-1 (never visible for 240728, see G1).
            if n == 1:
                pos = [0] if b == 0 else [L // 2]
            else:
                lo, hi = (0, L - 6) if b == 0 else (3, L - 1) if (b == B - 1 and B >= 2) else (5, L - 5)
                pos = sorted({round(lo + j * (hi - lo) / (n - 1)) for j in range(n)})
                assert len(pos) == n, ("--length too short for the images", pos)
        assert pos[-1] < L, "--length too short for the images"
        ids[b, pos] = image_id
    n_img = int((ids == image_id).sum())
    pixel_values = torch.rand(n_img, 3, S, S, generator=gen) * 2 - 1  # Normalize(0.5, 0.5) range
    labels = ordinary[torch.randint(len(ordinary), (B, L), generator=gen)]
    drop = torch.rand(B, L, generator=gen) < 0.25
    labels[drop | (ids == image_id)] = -100
    labels[:, 0] = -100
    save_file({"input_ids": ids.contiguous(), "pixel_values": pixel_values.contiguous(), "labels": labels.contiguous()},
              args.batch_file)
    print(f"wrote {args.batch_file}: input_ids {list(ids.shape)}, pixel_values {list(pixel_values.shape)}, "
          f"image positions {[media_positions(ids[b], image_id).tolist() for b in range(B)]}")


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------
def run(m, batch, backward=False, intermediates=False, mi_rope_delta=None):
    ids = batch["input_ids"].long()
    pv = batch.get("pixel_values")
    pv = pv.float().double() if pv is not None else torch.zeros(0, 3, 1, 1, dtype=torch.float64)
    inter = {} if intermediates else None
    result = {}
    params = m.parameters()
    for p in params.values():
        p.grad = None
    with torch.set_grad_enabled(backward):
        logits = forward(m, ids, pv, mi_rope_delta=mi_rope_delta, inter=inter)
        result["logits"] = logits
        if backward:
            loss = loss_fn(logits, batch["labels"].long())
            loss.backward()
            result["loss"] = loss
            for k in m.sd_keys:
                p = params[k]
                result["grad." + k] = p.grad if p.grad is not None else torch.zeros_like(p)
    if inter:
        result.update(inter)
    return {k: v.detach() for k, v in result.items()}


def cmd_run(args):
    t0 = time.time()
    torch.manual_seed(0)
    m = Model(args.out_dir, args.variant)
    batch = load_file(args.batch_file)
    ok, e32, e64, scale = text_only_check(m, batch["input_ids"].long())
    if not ok:
        sys.exit(f"SELF-CHECK FAILED: text-only logits differ from Qwen2ForCausalLM: max err {e32:.3g} "
                 f"(fp32 RMSNorm), {e64} (fp64 RMSNorm), |logits| {scale:.3g}")
    if args.backward and "labels" not in batch:
        sys.exit("--backward needs labels in the batch")
    res = run(m, batch, backward=args.backward, intermediates=args.intermediates)
    out = {k: v.float().contiguous() for k, v in res.items()}
    save_file(out, args.expected_file)
    msg = f" loss {out['loss'].item():.6f}" if args.backward else ""
    print(f"wrote {args.expected_file}: variant {m.variant}, logits {list(out['logits'].shape)}{msg}, "
          f"{len(out)} tensors; text-only vs Qwen2ForCausalLM max err {e32:.2g} (fp32 norm) / {e64:.2g} (fp64 norm); "
          f"{time.time() - t0:.1f} s")


def cmd_generate(args):
    m = Model(args.out_dir, "auto")
    batch = load_file(args.batch_file)
    ids = batch["input_ids"].long()
    pv = batch.get("pixel_values")
    pv = pv.float().double() if pv is not None else torch.zeros(0, 3, 1, 1, dtype=torch.float64)
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(args.tokens):
            last = forward(m, ids, pv)[:, -1]  # [B, V] fp64
            nxt = last.argmax(-1)
            tokens.append(nxt)
            logits.append(last)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    save_file({"tokens": torch.stack(tokens, 1).contiguous(),
               "step_logits": torch.stack(logits, 1).float().contiguous()}, args.expected_file)
    top2 = torch.stack(logits, 1).topk(2, dim=-1).values
    print(f"wrote {args.expected_file}: variant {m.variant}, tokens {torch.stack(tokens, 1).tolist()}, "
          f"smallest top-2 margin {float((top2[..., 0] - top2[..., 1]).min()):.3g}")


# ---------------------------------------------------------------------------------------------
# selfcheck
# ---------------------------------------------------------------------------------------------
class Checker:
    def __init__(self):
        self.failures = 0

    def __call__(self, ok, what):
        print(("  ok    " if ok else "  FAIL  ") + what)
        if not ok:
            self.failures += 1


def token_diff(a, b):
    return (a - b).abs().amax(-1)  # [B, L]


def changed_set(a, b, tol=1e-10):
    d = token_diff(a, b)
    return d > tol, d


def load_media_mask_ref():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "media_mask_ref.py")
    spec = importlib.util.spec_from_file_location("media_mask_ref", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cmd_selfcheck(args):
    t_start = time.time()
    work = args.workdir or tempfile.mkdtemp(prefix="mplug_ref_")
    os.makedirs(work, exist_ok=True)
    ck = Checker()
    try:
        mmr = load_media_mask_ref()
    except Exception as e:  # einops missing etc.
        mmr = None
        print(f"  (media_mask_ref.py not importable: {e}; mask cross-check skipped)")
    A = argparse.Namespace
    tokenizer_checks(ck)
    kv_split_check(ck)
    for variant in ("240728", "241101"):
        print(f"== variant {variant}")
        logits_by_shards = {}
        for shards in (1, 3):
            d = os.path.join(work, f"m{variant}_s{shards}")
            cmd_make_model(A(out_dir=d, variant=variant, seed=1, shards=shards, dtype="fp32"))
            m = Model(d)
            for layout in ("interleaved", "video_qa"):
                bf = os.path.join(work, f"b{variant}_{layout}.safetensors")
                cmd_make_batch(A(out_dir=d, batch_file=bf, seed=2, batch=2, length=96,
                                 images_per_sample="2,3", layout=layout))
                batch = load_file(bf)
                res = run(m, batch, backward=(shards == 1 and layout == "interleaved"))
                logits_by_shards[(shards, layout)] = res["logits"]
                if shards == 3:
                    continue
                sensitivity_checks(ck, m, batch, res, layout, mmr)
                if layout == "interleaved":
                    gradient_checks(ck, m, batch, res)
            if shards == 1:
                edge_checks(ck, m)
        for layout in ("interleaved", "video_qa"):
            ck(torch.equal(logits_by_shards[(1, layout)], logits_by_shards[(3, layout)]),
               f"{layout}: --shards 1 and 3 give identical logits")
        if variant == "240728":
            d = os.path.join(work, "m240728_bf16")
            cmd_make_model(A(out_dir=d, variant=variant, seed=1, shards=2, dtype="bf16"))
            mb = Model(d)
            r = run(mb, load_file(os.path.join(work, "b240728_interleaved.safetensors")))
            ok, e32, e64, _ = text_only_check(mb, load_file(os.path.join(work, "b240728_interleaved.safetensors"))["input_ids"])
            ck(bool(torch.isfinite(r["logits"]).all()) and ok, f"bf16 checkpoint (2 shards) loads and runs, text-only err {e64:.2g}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(f"selfcheck: {ck.failures} failure(s), {time.time() - t_start:.1f} s")
    sys.exit(1 if ck.failures else 0)


def _perturbed(m, ids, pv, fn, delta=None):
    """Logits for pixels pv (MI-RoPE shifted by delta) after fn() edits m.W in place; m.W restored."""
    saved = {k: w.detach().clone() for k, w in m.W.items()}
    with torch.no_grad():
        fn()
        out = forward(m, ids, pv, mi_rope_delta=delta)
        for k, w in m.W.items():
            w.copy_(saved[k])
    return out


def _visual_path_checks(ck, m, ids, pv, base, reach, layout):
    """Text-only logits == Qwen2ForCausalLM; dropping the images changes exactly the reachable rows."""
    ok, e32, e64, scale = text_only_check(m, ids)
    ck(ok, f"[{layout}] text-only logits == Qwen2ForCausalLM (max err {e32:.2g} with its fp32 RMSNorm, "
           f"{e64:.2g} with fp64 RMSNorm; |logits| <= {scale:.2g})")
    with torch.no_grad():
        nov = forward(m, ids, pv, use_images=False)
    ch, d = changed_set(base, nov)
    ck(torch.equal(ch, reach), f"[{layout}] visual path changes exactly the reachable rows "
                               f"(max change {d.max():.3g}, unreachable max {d[~reach].max() if (~reach).any() else 0:.2g})")


def _weight_sensitivity_checks(ck, m, ids, pv, base, reach, layout):
    """(a) the gate, (b) v_kv_proj and its K/V blocks, and the shared LayerNorm's scale blindness."""
    v = m.variant
    hl = m.hyper[0]
    if v == "240728":
        for lay in m.hyper:
            out = _perturbed(m, ids, pv, lambda: m.lw(lay, "self_attn.gate").add_(0.5))
            ch, d = changed_set(base, out)
            ck(torch.equal(ch, reach), f"[{layout}] (a) gate of layer {lay}: rows with count(t) > 0 change "
                                       f"(min {d[reach].min():.2g}), others exactly not")
    for name in ("self_attn.v_kv_proj.weight", "self_attn.v_kv_proj.bias"):
        for lay in m.hyper:
            out = _perturbed(m, ids, pv, lambda: m.lw(lay, name).add_(0.1 * torch.randn_like(m.lw(lay, name))))
            ch, d = changed_set(base, out)
            ck(torch.equal(ch, reach), f"[{layout}] (b) {name} of layer {lay}: exactly the reachable rows change "
                                       f"(min {d[reach].min():.2g})")
    # shared LayerNorm: RMSNorm before v_kv_proj makes the logits (almost: eps) blind to the scale of image_embeds
    def scale_projector():
        m.W["vision2text_model.2.weight"].mul_(3.0)
        m.W["vision2text_model.2.bias"].mul_(3.0)
    out = _perturbed(m, ids, pv, scale_projector)
    d = token_diff(base, out).max().item()
    ck(d < 1e-4, f"[{layout}] shared input_layernorm on image_embeds: scaling them by 3 changes logits by {d:.2g} (eps only)")
    # v_kv_proj layout: K rows of a KV head only change the logits through the keys
    D, nkv = m.D, m.nkv
    for part, sl in (("K", slice(0, D)), ("V", slice(D, 2 * D))):
        out = _perturbed(m, ids, pv, lambda: m.lw(hl, "self_attn.v_kv_proj.bias")[sl].add_(0.5))
        ch, d = changed_set(base, out)
        ck(bool(ch.any()), f"[{layout}] (b) v_kv_proj {part} block of KV head 0 (channels {sl.start}..{sl.stop - 1}) matters")


def _image_sensitivity_checks(ck, m, ids, pv, base, starts, first, t, layout):
    """(c) one image's pixels and (d) its MI-RoPE position change exactly the rows that see it."""
    v = m.variant
    B, L = ids.shape
    for b in range(B):
        for j, pos in enumerate(starts[b].tolist()):
            g = first[b] + j
            expect = torch.zeros(B, L, dtype=torch.bool)
            expect[b] = (t > pos) if v == "240728" else (t >= pos)
            pv2 = pv.clone()
            pv2[g] += 0.3 * torch.randn_like(pv2[g])
            out = _perturbed(m, ids, pv2, lambda: None)
            ch, d = changed_set(base, out)
            ck(torch.equal(ch, expect), f"[{layout}] (c) pixels of image {j} of sample {b} (<|image|> at {pos}): "
                                        f"changed rows {'t > ' if v == '240728' else 't >= '}{pos} of sample {b} only "
                                        f"(changed {int(ch.sum())}, expected {int(expect.sum())})")
            delta = torch.zeros(pv.shape[0], dtype=torch.int64)
            delta[g] = 1
            out = _perturbed(m, ids, pv, lambda: None, delta=delta)
            ch, d = changed_set(base, out)
            ck(torch.equal(ch, expect), f"[{layout}] (d) MI-RoPE position of image {j} of sample {b} +1: same rows change "
                                        f"(max {d.max():.2g})")


def _transcription_checks(ck, m, batch, ids, starts, layout, mmr):
    """Masks and MI-RoPE positions against the verbatim transcriptions in media_mask_ref.py."""
    v = m.variant
    B, L = ids.shape
    alt_checks(ck, m, batch, layout, mmr)
    T = (m.cfg["vision_config"]["image_size"] // m.cfg["vision_config"]["patch_size"]) ** 2
    slots = max(len(s) for s in starts)
    ref = (mmr.mplug_240728_visibility if v == "240728" else mmr.mplug_241101_visibility)(ids, m.image_id, T, slots)
    ours = torch.zeros_like(ref)
    for b in range(B):
        vis = image_visibility(L, starts[b], T, v)
        ours[b, :, : vis.shape[1]] = vis
    ck(torch.equal(ours, ref), f"[{layout}] t2v mask == media_mask_ref.py's verbatim {v} rule")
    if v == "240728":
        media_offset = mmr.batch_media_offset(ids, m.image_id)
        ok = True
        for b in range(B):
            curr = media_offset[b, L - 1]
            line = media_offset[b, :, 1] - curr[0]
            image_pos = (line[1:] - line[:-1]).nonzero().squeeze(1) + 1  # models.md §1.6 formula
            n_vis = int(curr[1] - curr[0])
            ok &= torch.equal(image_pos, mi_rope_positions(starts[b], v)[:n_vis])
        ck(ok, f"[{layout}] MI-RoPE positions == §1.6's image_pos = nonzero(diff(media_offset line)) + 1")


def sensitivity_checks(ck, m, batch, res, layout, mmr):
    """The logits rows the visual path, gate, v_kv_proj, each image and its MI-RoPE position reach."""
    v = m.variant
    ids, pv = batch["input_ids"].long(), batch["pixel_values"].double()
    B, L = ids.shape
    base = res["logits"]
    starts = [media_positions(ids[b], m.image_id) for b in range(B)]
    first = [sum(len(s) for s in starts[:b]) for b in range(B)]
    t = torch.arange(L)
    # rows any visual input can reach: 240728 count(t) > 0, 241101 t >= first image
    reach = torch.stack([(t[:, None] > s[None, :]).any(1) if v == "240728" else (t[:, None] >= s[None, :]).any(1)
                         for s in starts])
    print(f"  [{layout}] image positions {[s.tolist() for s in starts]}, logits std {base.std():.3f}")
    _visual_path_checks(ck, m, ids, pv, base, reach, layout)
    _weight_sensitivity_checks(ck, m, ids, pv, base, reach, layout)
    _image_sensitivity_checks(ck, m, ids, pv, base, starts, first, t, layout)
    if mmr is not None:
        _transcription_checks(ck, m, batch, ids, starts, layout, mmr)


def tokenizer_checks(ck):
    t1, t2 = build_tokenizer(), build_tokenizer()
    ck(t1.to_str() == t2.to_str(), "tokenizer training is deterministic")
    image_id = t1.token_to_id(IMAGE_TOKEN)
    text = "<|im_start|>user\n<|image|><|image|>What happens in the video?<|im_end|>\n<|im_start|>assistant\n"
    enc = t1.encode(text, add_special_tokens=False).ids
    ok = enc.count(image_id) == 2 and enc[0] == t1.token_to_id("<|im_start|>") and t1.decode(enc, skip_special_tokens=False) == text
    ck(ok, f"tokenizer: specials are single ids, round trip ({len(enc)} ids, <|image|> = {image_id})")


def kv_split_check(ck):
    """Our view-based v_kv_proj split == models.md §1.5's einops pattern (head-major K/V)."""
    from einops import rearrange
    n, T, nkv, D = 3, 5, 2, 4
    kv = torch.randn(n, T, nkv * 2 * D, dtype=torch.float64)
    ref = rearrange(kv, "BL Lv (H KV D) -> KV 1 H (BL Lv) D", KV=2, H=nkv)
    k, v = split_visual_kv(kv.reshape(n * T, -1), nkv, D)
    ck(torch.equal(k, ref[0, 0]) and torch.equal(v, ref[1, 0]),
       "v_kv_proj split == einops 'BL Lv (H KV D) -> KV 1 H (BL Lv) D'")


def edge_checks(ck, m):
    """Sample without images, a sample whose only image is at the last position, images at 0 and 1."""
    v, L = m.variant, 24
    S = m.cfg["vision_config"]["image_size"]
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, m.image_id - 3, (3, L), generator=gen)  # ordinary tokens (specials are last)
    ids[1, L - 1] = m.image_id
    ids[2, 0] = ids[2, 1] = m.image_id
    pv = torch.rand(3, 3, S, S, generator=gen, dtype=torch.float64) * 2 - 1
    with torch.no_grad():
        out = forward(m, ids, pv)
        txt = forward(m, ids, None, use_images=False)
    ch, d = changed_set(out, txt)
    expect = torch.zeros(3, L, dtype=torch.bool)
    if v == "240728":
        expect[2, 1:] = True  # sample 1: G1, pure self-attention
    else:
        expect[1, L - 1] = True
        expect[2, :] = True
    ck(torch.equal(ch, expect), f"edge batch (no image / only image at L-1 / images at 0,1): rows changed by images "
                                f"{[int(x) for x in ch.sum(1)]} == {[int(x) for x in expect.sum(1)]}")


def alt_hyper_ctx(m, i, x, image_embeds, ids, mmr):
    """A second, differently written hyper-layer attention (before o_proj), for the selfcheck only: einsum
    projections, complex-number RoPE, einops split (§1.5 pattern), media_mask_ref.py's verbatim masks,
    §1.6's image_pos formula and torch SDPA with enable_gqa."""
    from einops import rearrange
    B, L, H = x.shape
    nh, nkv, D, v = m.nh, m.nkv, m.D, m.variant
    T = image_embeds.shape[1]
    w = lambda n: m.lw(i, "self_attn." + n)

    def rope(t, pos):  # t [..., S, D]
        inv = 1.0 / (m.theta ** ((torch.arange(D // 2) * 2).float() / D))
        ang = pos.float()[:, None] * inv  # fp32, as the main path
        rot = torch.complex(ang.cos().double(), ang.sin().double())
        z = torch.complex(t[..., : D // 2], t[..., D // 2:]) * rot
        return torch.cat([z.real, z.imag], dim=-1)

    q = rope((torch.einsum("blc,oc->blo", x, w("q_proj.weight")) + w("q_proj.bias")).view(B, L, nh, D).transpose(1, 2), torch.arange(L))
    k = rope((torch.einsum("blc,oc->blo", x, w("k_proj.weight")) + w("k_proj.bias")).view(B, L, nkv, D).transpose(1, 2), torch.arange(L))
    val = (torch.einsum("blc,oc->blo", x, w("v_proj.weight")) + w("v_proj.bias")).view(B, L, nkv, D).transpose(1, 2)
    counts = [int((ids[b] == m.image_id).sum()) for b in range(B)]
    slots = max(counts)
    if v == "240728":
        vis = mmr.mplug_240728_visibility(ids, m.image_id, T, slots)
        media_offset = mmr.batch_media_offset(ids, m.image_id)
    else:
        vis = mmr.mplug_241101_visibility(ids, m.image_id, T, slots)
    sdpa = F.scaled_dot_product_attention
    out, lo = [], 0
    for b in range(B):
        n = counts[b]
        self_ctx = sdpa(q[b:b + 1], k[b:b + 1], val[b:b + 1], is_causal=True, enable_gqa=True)[0]
        if n == 0:
            out.append(self_ctx.transpose(0, 1).reshape(L, H))
            continue
        ln = m.lw(i, "input_layernorm.weight")
        img = image_embeds[lo: lo + n]
        img = ln * img / torch.sqrt((img * img).mean(-1, keepdim=True) + m.eps)
        kv = torch.einsum("ntc,oc->nto", img, w("v_kv_proj.weight")) + w("v_kv_proj.bias")
        vk, vv = rearrange(kv, "BL Lv (H KV D) -> KV 1 H (BL Lv) D", KV=2, H=nkv)
        if v == "240728":
            line = media_offset[b, :, 1] - media_offset[b, L - 1, 0]
            pos = (line[1:] - line[:-1]).nonzero().squeeze(1) + 1  # visible images only
            pos = torch.cat([pos, torch.full((n - len(pos),), L, dtype=pos.dtype)])  # never-visible last image
        else:
            pos = (ids[b] == m.image_id).nonzero().flatten()
        vk = rope(vk, pos.repeat_interleave(T))
        mask = vis[b, :, : n * T]
        if v == "240728":
            rows = mask.any(-1)
            ctx = self_ctx.transpose(0, 1).reshape(L, H).clone()
            if rows.any():
                cross = sdpa(q[b:b + 1, :, rows], vk, vv, attn_mask=mask[rows], enable_gqa=True)[0]
                g = torch.sigmoid(w("gate"))
                ctx[rows] = ctx[rows] * (1 - g) + cross.transpose(0, 1).reshape(-1, H) * g
            out.append(ctx)
        else:
            kk = torch.cat([vk[0], k[b]], dim=1)[None]
            vvv = torch.cat([vv[0], val[b]], dim=1)[None]
            full = torch.cat([mask, torch.ones(L, L, dtype=torch.bool).tril()], dim=1)
            out.append(sdpa(q[b:b + 1], kk, vvv, attn_mask=full, enable_gqa=True)[0].transpose(0, 1).reshape(L, H))
        lo += n
    return torch.stack(out)


def alt_checks(ck, m, batch, layout, mmr):
    ids, pv = batch["input_ids"].long(), batch["pixel_values"].double()
    inter = {}
    with torch.no_grad():
        forward(m, ids, pv, inter=inter)
        worst = max((alt_hyper_ctx(m, i, inter[f"attn_input.{i}"], inter["image_embeds"], ids, mmr)
                     - inter[f"ctx.{i}"]).abs().max().item() for i in m.hyper)
    ck(worst < 1e-12, f"[{layout}] hyper-layer attention == a second implementation (SDPA, einops, complex RoPE, "
                      f"media_mask_ref masks): max err {worst:.2g}")
    # §1.3 as a module: nn.Sequential(nn.Linear, nn.GELU(), nn.Linear) loading the vision2text_model.{0,2}.* keys
    H, Dv = m.H, m.cfg["vision_config"]["hidden_size"]
    proj = torch.nn.Sequential(torch.nn.Linear(Dv, H), torch.nn.GELU(), torch.nn.Linear(H, H)).double()
    proj.load_state_dict({k[len("vision2text_model."):]: t.detach() for k, t in m.W.items()
                          if k.startswith("vision2text_model.")}, strict=True)
    with torch.no_grad():
        err = (proj(inter["vision_features"]) - inter["image_embeds"]).abs().max().item()
    ck(err < 1e-13, f"[{layout}] projector == nn.Sequential(Linear, nn.GELU(), Linear) on vision2text_model.*: max err {err:.2g}")


def gradient_checks(ck, m, batch, res):
    ids, pv, labels = batch["input_ids"].long(), batch["pixel_values"].double(), batch["labels"].long()
    params = m.parameters()
    names = set(k[5:] for k in res if k.startswith("grad."))
    ck(names == set(m.sd_keys), f"grad.* for every checkpoint tensor ({len(names)})")
    nv = m.cfg["vision_config"]["num_hidden_layers"]
    unused = [k for k in m.sd_keys if k.startswith(("vision_model.head.", "vision_model.post_layernorm.",
                                                    f"vision_model.encoder.layers.{nv - 1}."))]
    ck(all(bool((res["grad." + k] == 0).all()) for k in unused), f"zero gradient for the {len(unused)} unused vision tensors")
    used_zero = [k for k in m.sd_keys if k not in unused and bool((res["grad." + k] == 0).all())]
    ck(not used_zero, "non-zero gradient for every used tensor" + (f" (zero: {used_zero[:5]})" if used_zero else ""))
    ck(all(bool(torch.isfinite(g).all()) for k, g in res.items()), "all outputs finite")
    # finite differences (central, fp64) on single elements
    probes = [("vision_model.embeddings.patch_embedding.weight", (3, 1, 2, 5)),
              ("vision_model.encoder.layers.0.self_attn.q_proj.weight", (4, 7)),
              ("vision2text_model.0.weight", (5, 3)),
              (f"language_model.model.layers.{m.hyper[0]}.self_attn.v_kv_proj.weight", (3, 11)),
              (f"language_model.model.layers.{m.hyper[-1]}.self_attn.v_kv_proj.bias", (m.D + 2,)),
              (f"language_model.model.layers.{m.hyper[0]}.input_layernorm.weight", (9,)),
              ("language_model.model.layers.0.self_attn.q_proj.bias", (17,)),
              ("language_model.lm_head.weight", (int(labels[labels >= 0][0]), 6))]
    if m.variant == "240728":
        probes.append((f"language_model.model.layers.{m.hyper[0]}.self_attn.gate", (13,)))
    worst = 0.0
    for name, idx in probes:
        p = params[name]
        eps = 1e-5
        with torch.no_grad():
            old = p[idx].item()
            p[idx] = old + eps
            lp = loss_fn(forward(m, ids, pv), labels).item()
            p[idx] = old - eps
            lm_ = loss_fn(forward(m, ids, pv), labels).item()
            p[idx] = old
        fd = (lp - lm_) / (2 * eps)
        an = res["grad." + name][idx].item()
        rel = abs(fd - an) / (1e-2 + abs(an))
        worst = max(worst, rel)
        if rel > 1e-6:
            ck(False, f"finite difference of {name}{list(idx)}: {fd:.8g} vs autograd {an:.8g}")
    ck(worst <= 1e-6, f"finite differences == autograd on {len(probes)} elements (worst |fd - ad| / (0.01 + |ad|) = {worst:.2g})")


# ---------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-model")
    p.add_argument("out_dir")
    p.add_argument("--variant", required=True, choices=["240728", "241101"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p = sub.add_parser("make-batch")
    p.add_argument("out_dir")
    p.add_argument("batch_file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=96)
    p.add_argument("--images-per-sample", default="2,3")
    p.add_argument("--layout", choices=["video_qa", "interleaved"], default="video_qa")
    p = sub.add_parser("run")
    p.add_argument("out_dir")
    p.add_argument("batch_file")
    p.add_argument("expected_file")
    p.add_argument("--backward", action="store_true")
    p.add_argument("--intermediates", action="store_true")
    p.add_argument("--variant", choices=["auto", "240728", "241101"], default="auto")
    p = sub.add_parser("generate")
    p.add_argument("out_dir")
    p.add_argument("batch_file")
    p.add_argument("expected_file")
    p.add_argument("--tokens", type=int, required=True)
    p = sub.add_parser("selfcheck")
    p.add_argument("--workdir", default=None, help="keep the generated files here")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    {"make-model": cmd_make_model, "make-batch": cmd_make_batch, "run": cmd_run, "generate": cmd_generate,
     "selfcheck": cmd_selfcheck}[args.cmd](args)


if __name__ == "__main__":
    main()
