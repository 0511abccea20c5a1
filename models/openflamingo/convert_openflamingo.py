#!/usr/bin/env python3
"""Convert an OpenFlamingo release into one directory lvx loads (safetensors + JSON, no pickle).

An OpenFlamingo release is three things that the open_flamingo package (2.0.1, factory.py)
stitches together at load time: the trainable part `checkpoint.pt` (perceiver, gated
cross-attention blocks, the resized LM embeddings), a Hugging Face causal LM directory (the
frozen decoder) and an open_clip vision tower (frozen). This script does that stitching once,
offline, and writes the result under the names the package's own `Flamingo` module gives every
tensor, without its duplicate aliases.

One self-contained file on purpose: users run it once, offline, on its own (docs/openflamingo.md),
and it needs nothing from the rest of the repository, only torch, safetensors, transformers and
open_clip.

usage:
  convert_openflamingo.py --checkpoint checkpoint.pt --lm LM_DIR [--tokenizer TOK_DIR]
      (--vision-model NAME | --vision-config OPEN_CLIP.json) --vision-pretrained FILE_OR_TAG
      --cross-attn-every-n-layers N --out OUT_DIR
      [--tokens-ln-post auto|true|false] [--vision-act auto|gelu|quick_gelu]
      [--perceiver-heads 8] [--xattn-heads 8] [--decoder-layers-attr ATTR]
      [--dtype float32|bfloat16|float16] [--max-shard-size 5GB]

Inputs
  --checkpoint   the release's checkpoint.pt: a plain state dict, loaded with
                 torch.load(weights_only=True) so a downloaded pickle cannot run code. A training
                 resume file ({"model_state_dict": ...}) and DDP "module." prefixes are accepted.
  --lm           the base LM directory (config.json, *.safetensors or pytorch_model*.bin, with
                 their index if sharded). Read tensor by tensor; the LM is never instantiated.
  --tokenizer    tokenizer directory (default: --lm); must load as a fast tokenizer.
  --vision-model / --vision-config
                 an open_clip model name (e.g. ViT-L-14-quickgelu), or an open_clip model config
                 JSON ({"embed_dim", "vision_cfg", "text_cfg", ...}; registered under its file
                 stem) for test models.
  --vision-pretrained
                 open_clip weights: a file (.safetensors/.bin/.pt state dict) or a pretrained tag.
  --cross-attn-every-n-layers
                 N of the release (3B: 1, 4B: 2, 9B: 4). Checked against the checkpoint's blocks.

Output directory
  config.json           model_type "openflamingo" (fields below)
  model.safetensors     or model-0000i-of-0000n.safetensors + model.safetensors.index.json
                        (Hugging Face layout) when larger than --max-shard-size
  tokenizer.json (+ tokenizer_config.json, special_tokens_map.json)
                        the LM tokenizer with "<|endofchunk|>", "<image>" (and "<PAD>" when the
                        tokenizer has no pad token) appended, as factory.py does

Tensor names (the Flamingo module's own state-dict names; D = LM width, i = decoder layer):
  vision_encoder.<open_clip VisionTransformer keys>
      conv1.weight [W,3,P,P] (no bias), class_embedding [W], positional_embedding [1+G*G, W],
      ln_pre.{weight,bias}, transformer.resblocks.{j}.{ln_1, attn.in_proj_weight [3W,W],
      attn.in_proj_bias [3W], attn.out_proj.{weight,bias}, ln_2, mlp.c_fc, mlp.c_proj},
      ln_post.{weight,bias}, proj [W, E] (proj only feeds the pooled CLIP embedding, which
      OpenFlamingo does not use)
  perceiver.latents [n_latents, W]
  perceiver.layers.{l}.0.{norm_media, norm_latents}.{weight,bias} [W]
  perceiver.layers.{l}.0.to_q.weight [h*dh, W], .0.to_kv.weight [2*h*dh, W], .0.to_out.weight [W, h*dh]
  perceiver.layers.{l}.1.0.{weight,bias} [W], .1.1.weight [mult*W, W], .1.3.weight [W, mult*W]
  perceiver.norm.{weight,bias} [W]
  lang_encoder.<layers_attr>.{i}.gated_cross_attn_layer.{attn_gate, ff_gate} [1]
      (only where (i + 1) % N == 0)
  lang_encoder.<layers_attr>.{i}.gated_cross_attn_layer.attn.norm.{weight,bias} [D]
  lang_encoder.<layers_attr>.{i}.gated_cross_attn_layer.attn.to_q.weight [512, D]
  lang_encoder.<layers_attr>.{i}.gated_cross_attn_layer.attn.to_kv.weight [1024, W]
  lang_encoder.<layers_attr>.{i}.gated_cross_attn_layer.attn.to_out.weight [D, 512]
  lang_encoder.<layers_attr>.{i}.gated_cross_attn_layer.ff.0.{weight,bias} [D], .ff.1.weight
      [4D, D], .ff.3.weight [D, 4D]
  lang_encoder.<layers_attr>.{i}.decoder_layer.<the base LM's layer keys>
  lang_encoder.<the base LM's other keys>  (embeddings resized to the new vocabulary, final norm,
      untied LM head; a tied head is not stored, as save_pretrained does)
  <layers_attr> = gpt_neox.layers (GPT-NeoX), transformer.blocks (MPT, MosaicGPT), model.layers
  (LLaMA), model.decoder.layers (OPT), transformer.h (GPT-J) (factory.py's table).
  LLaMA (model_type "llama"): lang_encoder.model.embed_tokens.weight [V, D] (from checkpoint.pt,
  the one embedding OpenFlamingo trains), lang_encoder.model.norm.weight [D] and the untied
  lang_encoder.lm_head.weight [V, D] (from the LM directory, resized: checkpoint.pt never holds it
  because filter_state_dict_to_trainable drops frozen keys without "embed"); per layer
  decoder_layer.{input_layernorm, post_attention_layernorm}.weight [D],
  self_attn.{q_proj [H*hd, D], k_proj [Hkv*hd, D], v_proj [Hkv*hd, D], o_proj [D, H*hd]}.weight,
  mlp.{gate_proj, up_proj [I, D], down_proj [D, I]}.weight (biases only with attention_bias /
  mlp_bias). The package's
  aliases lang_encoder.old_decoder_blocks.* and lang_encoder.gated_cross_attn_layers.* (the same
  tensors again) are not written.
  Which file a tensor comes from: checkpoint.pt wins (perceiver, gated blocks, embeddings and
  anything else it holds), then the LM directory, then the open_clip weights. LM buffers that
  are not parameters of the current transformers class (old GPT-NeoX files' attention.bias,
  masked_bias, rotary_emb.inv_freq) are dropped.

config.json fields
  model_type "openflamingo"; cross_attn_every_n_layers; cross_attn_layers (0-based decoder layer
  indexes that have a gated block); decoder_layers_attr; media_token_id and
  endofchunk_token_id (tokenizer.encode(tok)[-1], factory.py); pad_token_id; vocab_size (after
  resize = len(tokenizer)); base_vocab_size (the LM's config before); text_config = the LM's
  config.json verbatim except vocab_size (so model_type is gpt_neox, mpt, llama, ...);
  vision_config (open_clip ViT shape and behaviour, see vision_config()); perceiver_config;
  cross_attn_config; torch_dtype; converted_from (provenance).

Version traps recorded in vision_config:
  tokens_ln_post  whether ln_post is applied to the token output visual(x)[1]. open_clip >= 2.23
                  (3.3 here) applies it to the whole sequence; open_clip <= 2.22, which the
                  2023 releases were trained with, returned tokens before ln_post. "auto"
                  records what the installed open_clip does (measured by running the tower);
                  pass --tokens-ln-post false for the released checkpoints.
  act             QuickGELU vs GELU. open_clip 2.x built the "openai" tag with QuickGELU
                  (load_openai_model); open_clip 3.x builds ViT-L-14 with nn.GELU even for the
                  "openai" tag (it only warns). Use the ViT-L-14-quickgelu config (or
                  --vision-act quick_gelu) for the released checkpoints.
"""
import argparse
import json
import os
import re
import sys
import warnings

import torch

KNOWN_DECODER_LAYERS_ATTR = {  # open_flamingo/src/factory.py __KNOWN_DECODER_LAYERS_ATTR_NAMES, by model_type
    "gpt_neox": "gpt_neox.layers",
    "mpt": "transformer.blocks",
    "mosaic_gpt": "transformer.blocks",
    "llama": "model.layers",
    "opt": "model.decoder.layers",
    "gptj": "transformer.h",
}
DUPLICATE_PREFIXES = ("lang_encoder.old_decoder_blocks.", "lang_encoder.gated_cross_attn_layers.")
# Buffers that older transformers versions saved with GPT-NeoX/GPT-J/OPT weights; not parameters.
STALE_BUFFER = re.compile(r"(\.attention\.bias|\.attention\.masked_bias|\.attn\.bias|\.attn\.masked_bias|"
                          r"rotary_emb\.inv_freq|\.rotary_emb\.cos_cached|\.rotary_emb\.sin_cached)$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def log(*a):
    print("convert_openflamingo:", *a, file=sys.stderr)


def fail(msg):
    raise SystemExit("convert_openflamingo: error: " + msg)


# ---- inputs ------------------------------------------------------------------------------------
def load_checkpoint(path):
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(sd, dict) and "model_state_dict" in sd:  # open_flamingo train.py resume files
        sd = sd["model_state_dict"]
    if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
        fail(f"--checkpoint {path}: expected a state dict of tensors")
    out = {}
    for k, v in sd.items():
        k = k[len("module."):] if k.startswith("module.") else k  # DDP
        k = k.replace("._checkpoint_wrapped_module", "").replace("._fsdp_wrapped_module", "")
        if k.startswith(DUPLICATE_PREFIXES):
            continue
        out[k] = v
    return out


class LMWeights:
    """Lazy access to a Hugging Face model directory's tensors (safetensors or torch .bin)."""

    def __init__(self, lm_dir):
        self.dir = lm_dir
        self.where = {}
        self._bin_cache = (None, None)
        for index, single in (("model.safetensors.index.json", "model.safetensors"),
                              ("pytorch_model.bin.index.json", "pytorch_model.bin")):
            if os.path.exists(os.path.join(lm_dir, index)):
                with open(os.path.join(lm_dir, index)) as f:
                    self.where = dict(json.load(f)["weight_map"])
                break
            if os.path.exists(os.path.join(lm_dir, single)):
                self.where = {k: single for k in self._keys_of(single)}
                break
        if not self.where:
            fail(f"--lm {lm_dir}: no model.safetensors, pytorch_model.bin or index found")

    def _keys_of(self, fname):
        path = os.path.join(self.dir, fname)
        if fname.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(path, "pt") as f:
                return list(f.keys())
        return list(self._bin(fname).keys())

    def _bin(self, fname):
        if self._bin_cache[0] != fname:
            path = os.path.join(self.dir, fname)
            try:
                sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (non-zip) torch files cannot be memory-mapped
                sd = torch.load(path, map_location="cpu", weights_only=True)
            self._bin_cache = (fname, sd)
        return self._bin_cache[1]

    def keys(self):
        return list(self.where)

    def get(self, key):
        fname = self.where[key]
        if fname.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(os.path.join(self.dir, fname), "pt") as f:
                return f.get_tensor(key)
        return self._bin(fname)[key]

    def shape(self, key):
        fname = self.where[key]
        if fname.endswith(".safetensors"):
            from safetensors import safe_open
            with safe_open(os.path.join(self.dir, fname), "pt") as f:
                return tuple(f.get_slice(key).get_shape())
        return tuple(self._bin(fname)[key].shape)


def lm_structure(lm_dir):
    """Parameter names and shapes of the LM as the installed transformers builds it (on the meta
    device, no weights), the names of its input/output embeddings and whether they are tied.
    None for model types transformers does not know without remote code (e.g. mosaic_gpt)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.from_pretrained(lm_dir, local_files_only=True, trust_remote_code=False)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)
    except Exception as e:  # remote-code LMs: fall back to the file's own names
        log(f"transformers cannot build {lm_dir} without remote code ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:160]}); "
            "taking parameter names from the weight files")
        return None
    named = list(model.named_parameters(remove_duplicate=False))
    inp = model.get_input_embeddings().weight
    outm = model.get_output_embeddings()
    in_name = next(n for n, p in named if p is inp)
    out_names = [] if outm is None else [n for n, p in named if p is outm.weight and n != in_name]
    tied = outm is not None and outm.weight is inp
    return {"params": {n: tuple(p.shape) for n, p in named}, "input_embedding": in_name,
            "output_embedding": None if tied or not out_names else out_names[0],
            "tied_names": out_names if tied else [], "tied": tied}


def build_tokenizer(tok_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True, trust_remote_code=False)
    if not tok.is_fast:
        fail(f"--tokenizer {tok_dir}: a fast tokenizer (tokenizer.json) is needed")
    # exactly factory.py's steps
    tok.add_special_tokens({"additional_special_tokens": ["<|endofchunk|>", "<image>"]})
    if tok.pad_token is None:
        tok.add_special_tokens({"pad_token": "<PAD>"})
    return tok


def load_vision(args):
    import open_clip
    name = args.vision_model
    if args.vision_config:
        open_clip.add_model_config(args.vision_config)
        name = os.path.splitext(os.path.basename(args.vision_config))[0]
    model = open_clip.create_model(name, pretrained=args.vision_pretrained, device="cpu")
    model.eval()
    return name, model, open_clip.get_model_preprocess_cfg(model)


def vision_config(name, clip, preprocess, args):
    """The open_clip ViT as lvx must run it, measured on the instantiated tower."""
    from open_clip.transformer import QuickGELU, VisionTransformer
    v = clip.visual
    if not isinstance(v, VisionTransformer):
        fail(f"vision model {name}: only open_clip VisionTransformer towers are supported, got {type(v).__name__}")
    if v.attn_pool is not None:
        fail(f"vision model {name}: attentional pooling is not supported")
    blk = v.transformer.resblocks[0]
    if not hasattr(blk.attn, "in_proj_weight") or type(blk).__name__ != "ResidualAttentionBlock":
        fail(f"vision model {name}: custom attention blocks (qk_norm, scaled cosine, ...) are not supported")
    act_mod = blk.mlp.gelu
    if isinstance(act_mod, QuickGELU):
        act = "quick_gelu"
    elif isinstance(act_mod, torch.nn.GELU):
        act = "gelu" if act_mod.approximate == "none" else "gelu_tanh"
    else:
        fail(f"vision model {name}: unknown activation {type(act_mod).__name__}")
    measured_act = act
    if args.vision_act != "auto":
        act = args.vision_act
    elif act == "gelu" and str(args.vision_pretrained).lower() == "openai":
        warnings.warn("open_clip >= 3 builds the 'openai' tag with nn.GELU; the OpenAI weights (and "
                      "OpenFlamingo, trained with open_clip 2.x) use QuickGELU: recording quick_gelu")
        act = "quick_gelu"

    # Which tokens does visual(x)[1] return: ln_post applied or not (the open_clip version trap).
    H, W = v.image_size
    x = torch.randn(2, 3, H, W, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v.output_tokens = True
        _, tokens = v(x)
        h = v.transformer(v._embeds(x))
        drop_cls = v.pool_type != "none"
        raw = h[:, 1:] if drop_cls else h
        post = v.ln_post(h)[:, 1:] if drop_cls else v.ln_post(h)
    if torch.allclose(tokens, post, atol=1e-5, rtol=1e-5):
        measured_ln_post = True
    elif torch.allclose(tokens, raw, atol=1e-5, rtol=1e-5):
        measured_ln_post = False
    else:
        fail(f"vision model {name}: visual(x)[1] is neither the pre- nor the post-ln_post tokens")
    ln_post = measured_ln_post if args.tokens_ln_post == "auto" else args.tokens_ln_post == "true"

    import importlib.metadata as md
    width = v.transformer.width
    mlp_width = blk.mlp.c_fc.out_features
    gh, gw = v.grid_size
    ls = not isinstance(blk.ls_1, torch.nn.Identity)
    return {
        "source": "open_clip",
        "model_name": name,
        "image_size": H if H == W else [H, W],
        "patch_size": v.patch_size[0],
        "width": width,
        "layers": v.transformer.layers,
        "heads": blk.attn.num_heads,
        "head_width": width // blk.attn.num_heads,
        "mlp_ratio": mlp_width / width,
        "mlp_width": mlp_width,
        "act": act,
        "act_in_instantiated_model": measured_act,
        "ln_pre": not isinstance(v.ln_pre, torch.nn.Identity),
        "class_token": True,
        "positional_embedding": "learned [1 + grid*grid, width], class token first",
        "layer_scale": ls,
        "patch_embed_bias": v.conv1.bias is not None,
        "norm_eps": v.ln_post.eps,
        "num_tokens": gh * gw if drop_cls else gh * gw + 1,
        "tokens": ("visual(x)[1] (open_clip output_tokens=True): the transformer's output sequence "
                   + ("without the class token" if drop_cls else "including the class token")),
        "tokens_ln_post": ln_post,
        "tokens_ln_post_measured": measured_ln_post,
        "measured_with": f"open_clip_torch {md.version('open_clip_torch')}",
        "output_dim": v.output_dim,
        "preprocess": {k: (list(val) if isinstance(val, tuple) else val) for k, val in preprocess.items()},
    }


# ---- planning ----------------------------------------------------------------------------------
class Plan:
    """Output tensor name -> (loader, shape). Loaders run only while writing."""

    def __init__(self):
        self.items = {}

    def add(self, name, loader, shape):
        if name in self.items:
            fail(f"duplicate output tensor {name}")
        self.items[name] = (loader, tuple(shape))


def resize_rows(t, rows, what):
    """transformers' resize_token_embeddings keeps the first rows; new rows (tokens the checkpoint
    does not provide) get the mean row (transformers samples them at random, so no file has them)."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows]
    warnings.warn(f"{what}: {rows - t.shape[0]} new rows not in the checkpoint; filled with the mean row")
    return torch.cat([t, t.float().mean(0, keepdim=True).to(t.dtype).expand(rows - t.shape[0], -1)])


def _plan_vision_perceiver(plan, ckpt, vision_sd, from_ckpt):
    """Plans the vision encoder (open_clip keys, the checkpoint's copies first) and the perceiver."""
    # vision encoder: open_clip visual keys (the checkpoint may override, e.g. unfrozen towers)
    for k, t in vision_sd.items():
        name = "vision_encoder." + k
        plan.add(name, from_ckpt(name) if name in ckpt else (lambda t=t: t), t.shape)
    # perceiver: only from the checkpoint
    for k in ckpt:
        if k.startswith("perceiver."):
            plan.add(k, from_ckpt(k), ckpt[k].shape)
    if not any(k.startswith("perceiver.") for k in plan.items):
        fail("--checkpoint has no perceiver.* tensors (is it an OpenFlamingo checkpoint.pt?)")


def _lm_keys(args, ckpt, lm, lm_struct, text_config, tied, base_rows):
    """The LM tensors to write, in order, and the names of its (resized) embeddings."""
    if lm_struct:
        lm_params = dict(lm_struct["params"])
        for n in lm_struct["tied_names"]:
            lm_params.pop(n, None)
        embed_names = {lm_struct["input_embedding"]}
        if lm_struct["output_embedding"]:
            embed_names.add(lm_struct["output_embedding"])
        missing = [k for k in lm_params if k not in lm.where and "lang_encoder." + k not in ckpt]
        if missing:
            fail(f"--lm {args.lm}: tensors missing from the weight files: {missing[:5]}")
        dropped = [k for k in lm.keys() if k not in lm_params]
        if dropped:
            log(f"dropping {len(dropped)} LM tensors that are not parameters: {dropped[:4]}...")
        lm_keys = list(lm_params)
    else:
        lm_keys = [k for k in lm.keys() if not STALE_BUFFER.search(k)]
        if tied:
            lm_keys = [k for k in lm_keys if k != "lm_head.weight"]
        embed_names = {k for k in lm_keys if k.endswith(".weight") and lm.shape(k)[0] == base_rows}
    return lm_keys, embed_names


def _decoder_layers(args, ckpt, lm_keys, layer_re):
    """The decoder layer count and the layers with a gated block, checked against the checkpoint."""
    attr = args.decoder_layers_attr
    gated_re = re.compile("^lang_encoder." + re.escape(attr) + r"\.(\d+)\.gated_cross_attn_layer\.")
    gated_layers = sorted({int(m.group(1)) for k in ckpt for m in [gated_re.match(k)] if m})
    n_layers = max([int(m.group(1)) for k in lm_keys for m in [layer_re.match(k)] if m], default=-1) + 1
    if n_layers == 0:
        fail(f"--decoder-layers-attr {attr}: no LM tensor is under it")
    want = [i for i in range(n_layers) if (i + 1) % args.cross_attn_every_n_layers == 0]
    if gated_layers != want:
        fail(f"--cross-attn-every-n-layers {args.cross_attn_every_n_layers}: expects gated blocks at "
             f"layers {want}, the checkpoint has them at {gated_layers}")
    return n_layers, want


def _plan_lm(plan, args, ckpt, lm, lm_keys, embed_names, vocab, layer_re, n_layers, from_ckpt):
    """Plans the LM tensors and the gated blocks in module order (lang_encoder.*)."""
    attr = args.decoder_layers_attr
    by_layer = {i: [] for i in range(n_layers)}
    other = []
    for k in lm_keys:
        m = layer_re.match(k)
        (by_layer[int(m.group(1))] if m else other).append(k)
    gated_of = {i: [k for k in ckpt if k.startswith(f"lang_encoder.{attr}.{i}.gated_cross_attn_layer.")]
                for i in range(n_layers)}

    def add_lm(k, out):
        """LM tensor k under output name out: the checkpoint's copy if it has one, else the LM's."""
        if out in ckpt:
            t = ckpt[out]
            if k in embed_names and t.shape[0] != vocab:
                fail(f"--checkpoint {out}: {t.shape[0]} rows, the tokenizer has {vocab} tokens")
            plan.add(out, from_ckpt(out), t.shape)
        elif k in embed_names:
            shape = (vocab,) + tuple(lm.shape(k))[1:]
            plan.add(out, lambda k=k: resize_rows(lm.get(k), vocab, k), shape)
        else:
            plan.add(out, lambda k=k: lm.get(k), lm.shape(k))

    # Module order: embeddings and the rest of the LM keep their order; each layer's gated block
    # comes before its decoder layer (FlamingoLayer runs it first).
    pre, post = [], []
    first_layer_seen = False
    for k in lm_keys:
        if layer_re.match(k):
            first_layer_seen = True
        elif k in other:
            (post if first_layer_seen else pre).append(k)
    for k in pre:
        add_lm(k, "lang_encoder." + k)
    for i in range(n_layers):
        for g in gated_of[i]:
            plan.add(g, from_ckpt(g), ckpt[g].shape)
        for k in by_layer[i]:
            rest = layer_re.match(k).group(2)
            add_lm(k, f"lang_encoder.{attr}.{i}.decoder_layer.{rest}")
    for k in post:
        add_lm(k, "lang_encoder." + k)


def _check_tied_head(ckpt, lm_struct, embed_names, used):
    """A tied head the checkpoint repeats must equal its embedding; it then counts as used."""
    # A tied head the checkpoint repeats (filter_state_dict_to_trainable keeps every state-dict
    # key it does not iterate over) must equal the embedding it is tied to.
    in_name = "lang_encoder." + (lm_struct["input_embedding"] if lm_struct else
                                 next(iter(sorted(embed_names)), ""))
    for n in (lm_struct["tied_names"] if lm_struct else ["lm_head.weight"]):
        ck = "lang_encoder." + n
        if ck in ckpt:
            used.add(ck)
            if in_name in ckpt and not torch.equal(ckpt[ck], ckpt[in_name]):
                fail(f"--checkpoint: {ck} differs from the tied {in_name}")


def plan_tensors(args, ckpt, lm, lm_struct, text_config, vision_sd, vocab):
    """Output tensors (name, loader, shape) in module order: plan, n_layers, gated layers, base vocab."""
    plan = Plan()
    attr = args.decoder_layers_attr
    layer_re = re.compile("^" + re.escape(attr) + r"\.(\d+)\.(.*)$")
    used = set()

    def from_ckpt(k):
        used.add(k)
        return lambda: ckpt[k]

    _plan_vision_perceiver(plan, ckpt, vision_sd, from_ckpt)
    # language model
    base_rows = text_config.get("vocab_size")
    tied = lm_struct["tied"] if lm_struct else bool(text_config.get("tie_word_embeddings", True))
    lm_keys, embed_names = _lm_keys(args, ckpt, lm, lm_struct, text_config, tied, base_rows)
    n_layers, want = _decoder_layers(args, ckpt, lm_keys, layer_re)
    _plan_lm(plan, args, ckpt, lm, lm_keys, embed_names, vocab, layer_re, n_layers, from_ckpt)
    if tied:
        _check_tied_head(ckpt, lm_struct, embed_names, used)
    leftover = [k for k in ckpt if k not in used]
    if leftover:
        fail(f"--checkpoint tensors with no place in the model: {leftover[:6]}")
    return plan, n_layers, want, base_rows


def perceiver_config(ckpt, heads):
    lat = ckpt["perceiver.latents"]
    depth = len({k.split(".")[2] for k in ckpt if k.startswith("perceiver.layers.")})
    inner = ckpt["perceiver.layers.0.0.to_q.weight"].shape[0]
    if inner % heads:
        fail(f"--perceiver-heads {heads}: does not divide the perceiver's inner width {inner}")
    return {
        "dim": lat.shape[1], "depth": depth, "heads": heads, "dim_head": inner // heads,
        "num_latents": lat.shape[0],
        "ff_mult": ckpt["perceiver.layers.0.1.1.weight"].shape[0] // lat.shape[1],
        "max_num_media": ckpt["perceiver.media_time_embs"].shape[0] if "perceiver.media_time_embs" in ckpt else None,
        "max_num_frames": ckpt["perceiver.frame_embs"].shape[0] if "perceiver.frame_embs" in ckpt else None,
        "norm_eps": 1e-5,
    }


def cross_attn_config(ckpt, attr, layer, heads, lang_dim):
    p = f"lang_encoder.{attr}.{layer}.gated_cross_attn_layer."
    inner, dim = ckpt[p + "attn.to_q.weight"].shape
    if inner % heads:
        fail(f"--xattn-heads {heads}: does not divide the cross-attention inner width {inner}")
    if dim != lang_dim:
        fail(f"gated block width {dim} != LM width {lang_dim}")
    return {
        "dim": dim, "heads": heads, "dim_head": inner // heads,
        "dim_visual": ckpt[p + "attn.to_kv.weight"].shape[1],
        "ff_mult": ckpt[p + "ff.1.weight"].shape[0] // dim,
        "only_attend_immediate_media": True,
        "norm_eps": 1e-5,
    }


# ---- writing -----------------------------------------------------------------------------------
def parse_size(s):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", s.upper())
    if not m:
        fail(f"--max-shard-size {s}: expected e.g. 5GB, 500MB or a byte count")
    return int(float(m.group(1)) * {"": 1, "B": 1, "KB": 10**3, "K": 10**3, "MB": 10**6, "M": 10**6,
                                    "GB": 10**9, "G": 10**9}[m.group(2)])


def write_tensors(plan, out_dir, dtype, max_shard):
    from safetensors.torch import save_file
    def nbytes(shape, dt):
        n = 1
        for s in shape:
            n *= s
        return n * torch.empty((), dtype=dt).element_size()

    shards, cur, cur_size = [], [], 0
    for name, (_, shape) in plan.items.items():
        b = nbytes(shape, dtype)
        if cur and cur_size + b > max_shard:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(name)
        cur_size += b
    shards.append(cur)
    for f in os.listdir(out_dir):
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", f):
            os.remove(os.path.join(out_dir, f))
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for n in names:
            loader, shape = plan.items[n]
            t = loader()
            if tuple(t.shape) != shape:
                fail(f"{n}: planned shape {shape}, got {tuple(t.shape)}")
            tensors[n] = t.to(dtype).contiguous().clone()
            total += tensors[n].numel() * tensors[n].element_size()
            weight_map[n] = fname
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        log(f"wrote {fname} ({len(names)} tensors)")
    if len(shards) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def convert(args):
    os.makedirs(args.out, exist_ok=True)
    if args.vision_config is None and args.vision_model is None:
        fail("one of --vision-model or --vision-config is needed")
    ckpt = load_checkpoint(args.checkpoint)
    with open(os.path.join(args.lm, "config.json")) as f:
        text_config = json.load(f)
    model_type = text_config.get("model_type")
    if args.decoder_layers_attr is None:
        if model_type not in KNOWN_DECODER_LAYERS_ATTR:
            fail(f"LM model_type {model_type!r}: pass --decoder-layers-attr")
        args.decoder_layers_attr = KNOWN_DECODER_LAYERS_ATTR[model_type]

    tok = build_tokenizer(args.tokenizer or args.lm)
    vocab = len(tok)
    media_id = tok.encode("<image>")[-1]
    eoc_id = tok.encode("<|endofchunk|>")[-1]

    name, clip, preprocess = load_vision(args)
    vcfg = vision_config(name, clip, preprocess, args)
    vision_sd = {k: v.detach() for k, v in clip.visual.state_dict().items()}

    lm = LMWeights(args.lm)
    lm_struct = lm_structure(args.lm)
    plan, n_layers, xattn_layers, base_vocab = plan_tensors(args, ckpt, lm, lm_struct, text_config,
                                                            vision_sd, vocab)
    lang_dim = text_config.get("d_model", text_config.get("hidden_size"))
    pcfg = perceiver_config(ckpt, args.perceiver_heads)
    xcfg = cross_attn_config(ckpt, args.decoder_layers_attr, xattn_layers[0], args.xattn_heads, lang_dim)
    if pcfg["dim"] != vcfg["width"] or xcfg["dim_visual"] != vcfg["width"]:
        fail(f"vision width {vcfg['width']} != perceiver dim {pcfg['dim']} / cross-attn dim_visual {xcfg['dim_visual']}")

    text_config = dict(text_config)
    text_config["vocab_size"] = vocab  # resize_token_embeddings(len(tokenizer)) updates the config
    import importlib.metadata as md
    config = {
        "model_type": "openflamingo",
        "architectures": ["Flamingo"],
        "cross_attn_every_n_layers": args.cross_attn_every_n_layers,
        "cross_attn_layers": xattn_layers,
        "num_decoder_layers": n_layers,
        "decoder_layers_attr": args.decoder_layers_attr,
        "media_token_id": media_id,
        "endofchunk_token_id": eoc_id,
        "pad_token_id": tok.pad_token_id,
        "vocab_size": vocab,
        "base_vocab_size": base_vocab,
        "tie_word_embeddings": bool(lm_struct["tied"]) if lm_struct else bool(text_config.get("tie_word_embeddings", True)),
        "text_config": text_config,
        "vision_config": vcfg,
        "perceiver_config": pcfg,
        "cross_attn_config": xcfg,
        "torch_dtype": args.dtype,
        "converted_from": {
            "checkpoint": os.path.basename(args.checkpoint),
            "lm": os.path.basename(os.path.normpath(args.lm)),
            "vision": name, "vision_pretrained": os.path.basename(str(args.vision_pretrained)),
            "open_flamingo_reference": "open-flamingo 2.0.1 (factory.py, flamingo.py, helpers.py)",
            "transformers": md.version("transformers"), "open_clip_torch": md.version("open_clip_torch"),
        },
    }
    write_tensors(plan, args.out, DTYPES[args.dtype], parse_size(args.max_shard_size))
    tok.save_pretrained(args.out)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    log(f"wrote {args.out}: {len(plan.items)} tensors, vocab {vocab}, <image>={media_id}, "
        f"<|endofchunk|>={eoc_id}, gated blocks at {xattn_layers}")
    return config


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="the release's checkpoint.pt")
    p.add_argument("--lm", required=True, help="base LM directory (Hugging Face layout)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --lm)")
    p.add_argument("--vision-model", help="open_clip model name, e.g. ViT-L-14-quickgelu")
    p.add_argument("--vision-config", help="open_clip model config JSON (test models)")
    p.add_argument("--vision-pretrained", required=True, help="open_clip weights file or pretrained tag")
    p.add_argument("--cross-attn-every-n-layers", type=int, required=True)
    p.add_argument("--decoder-layers-attr", help="LM decoder layer list (default: from model_type)")
    p.add_argument("--perceiver-heads", type=int, default=8, help="PerceiverResampler heads (package default 8)")
    p.add_argument("--xattn-heads", type=int, default=8, help="MaskedCrossAttention heads (package default 8)")
    p.add_argument("--tokens-ln-post", choices=("auto", "true", "false"), default="auto",
                   help="ln_post on the vision tokens; auto = what the installed open_clip does; "
                        "false for the 2023 releases")
    p.add_argument("--vision-act", choices=("auto", "gelu", "quick_gelu", "gelu_tanh"), default="auto")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--out", required=True, help="output directory")
    return p


def main(argv=None):
    convert(parser().parse_args(argv))


if __name__ == "__main__":
    main()
