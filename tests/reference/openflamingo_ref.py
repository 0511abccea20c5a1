#!/usr/bin/env python3
"""OpenFlamingo reference: tiny random models built with the real open_flamingo package (2.0.1),
converted by models/openflamingo/convert_openflamingo.py, and the package's own forward/backward on them.

One file on purpose: the C++ tests cache what it generates keyed by file content (script_stamp in
tests/model_conformance.h reads only this script and requirements.txt / requirements-nodeps.txt;
the OpenFlamingo tests add the converter it imports), so everything else that shapes the expected
values stays in this one file.

usage:
  openflamingo_ref.py make-model OUT_DIR --lm gpt_neox|mpt|llama [--seed S] [--rotary-pct P]
        [--parallel-residual] [--kv-heads K] [--tokens-ln-post true|false] [--perceiver tiny|default]
  openflamingo_ref.py make-batch OUT_DIR BATCH.safetensors [--seed S] [--batch B] [--length L]
        [--images T]
  openflamingo_ref.py run OUT_DIR BATCH.safetensors EXPECTED.safetensors [--backward] [--float32]
  openflamingo_ref.py generate OUT_DIR BATCH.safetensors EXPECTED.safetensors --tokens N
  openflamingo_ref.py selfcheck OUT_DIR [--lm gpt_neox|mpt|llama|all]

make-model  builds the tiny model with open_flamingo.create_model_and_transforms (a tiny open_clip
            ViT registered with open_clip.add_model_config, a tiny GPTNeoXForCausalLM,
            MptForCausalLM or LlamaForCausalLM (hidden 64, 4 layers, 4 heads, --kv-heads 2 KV heads,
            SwiGLU 96, rope_theta 1e4, rms_norm_eps 1e-6, no biases, untied lm_head) saved with
            save_pretrained beside a byte-level BPE tokenizer), shrinks the perceiver (same
            PerceiverResampler class), randomizes what init leaves at 0/1 (gates, LayerNorm and
            RMSNorm affine, biases), saves it the way a release is saved under OUT_DIR/release/
            (checkpoint.pt = open_flamingo train_utils.filter_state_dict_to_trainable of the state
            dict; lm/; tiny-vit.json + open_clip_model.safetensors) and converts that into OUT_DIR.
make-batch  random prompts in OpenFlamingo's format. BATCH holds input_ids int64 [B, L] (text, then
            per image "<image> text... <|endofchunk|>", then eos; every sample has >= 1 text token
            before its first image), attention_mask int64 [B, L] (ones), pixel_values float32
            [N_img, 3, H, W] (sample 0's images in prompt order, then sample 1's, ...),
            images_per_sample int64 [B] and labels int64 [B, L] (not shifted: labels[t] is the
            token at t + 1; −100 at the last position, where the target is <image>, and at ~15%
            random positions). Every sample has the same number of images because the package
            takes vision_x as [B, T_img, F=1, C, H, W].
run         rebuilds the package model from OUT_DIR alone (config.json, model.safetensors),
            runs Flamingo.forward(vision_x, lang_x, attention_mask=ones, labels=None) in float64
            (--float32 to stay in float32) and writes float32: logits [B, L, V];
            intermediate.vision_tokens [N_img, n_tok, W] (vision_encoder(x)[1]),
            intermediate.media [B, T_img, n_latents, W] (perceiver output),
            intermediate.xattn_out.{i} [B, L, D] (residual stream after layer i's gated block).
            With --backward also loss (scalar: mean cross-entropy of logits[t] vs labels[t] over
            labels != −100, computed here from the logits) and grad.<name> for EVERY tensor of
            model.safetensors under its converted name (vision encoder included: the package runs
            the vision tower under no_grad, so run swaps in a copy of _encode_vision_x without it;
            parameters the loss does not reach, e.g. vision_encoder.proj, get zeros).
            OpenFlamingo itself trains perceiver.*, *.gated_cross_attn_layer.* and the input
            embedding; lvx's trainable set is perceiver.*, *.gated_cross_attn_layer.* and the LM
            decoder layers (*.decoder_layer.*); compare whichever subset the C++ side writes.
            Precision notes: transformers computes GPT-NeoX's and LLaMA's rotary cos/sin, MPT's
            attention softmax and LLaMA's RMSNorm statistics (x * rsqrt(mean(x^2) + eps), then
            cast back before the weight) in float32 even in a float64 model, so those parts are
            fp32-accurate (LLaMA's attention itself runs through sdpa in float64).
generate    greedy decoding WITHOUT a cache with the package model rebuilt as run does (float64):
            for each of N steps the whole Flamingo.forward on the prompt + the tokens chosen so far
            (same vision_x), argmax of the last position's logits (the lowest id on ties). The
            package gives an appended token the last image: text_time = cumsum(media_locations)
            = the sample's image count, the rule of its cached generation (use_cached_media).
            A chosen <image> token would be a new, imageless media position: an error. Writes
            tokens int64 [B, N] and step_logits float32 [B, N, V]; prints the smallest top-2
            margin (how far the greedy choices are from a tie).
selfcheck   for each LM: make-model into OUT_DIR/<lm>, then reloads the converted files into a
            fresh package model and checks: the converted key set is the package state dict minus
            its aliases (no duplicates) and every tensor equals the original's, logits are
            bit-identical to the in-memory original, spec_forward (a plain-torch forward written
            from the package code, the math lvx implements) matches the package in float64,
            with every gate at 0 the logits equal the base LM (AutoModelForCausalLM) run on the
            converted LM tensors, perturbing one attn_gate or the pixels changes logits at every
            position from the first <image> on and none before it. Then a variant of each
            (GPT-NeoX: rotary_pct 0.25, parallel residual, tokens before ln_post, the package's
            default perceiver; MPT: tokens before ln_post; LLaMA: one KV head (MQA), tokens before
            ln_post) for the conversion and spec checks.
            spec_forward agrees with the package to ~1e-7 (LLaMA ~1e-6); emulating the package's
            float32 rotary inv_freq and MPT float32 softmax in it gives ~4e-15, and LLaMA's float32
            cos/sin gives exactly 0 (checked by hand; spec_forward already does LLaMA's inv_freq and
            RMSNorm statistics in float32 as transformers does).
"""
import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "models", "openflamingo"))
import convert_openflamingo as conv  # noqa: E402

TINY_PERCEIVER = {"depth": 2, "heads": 4, "dim_head": 16, "num_latents": 8, "ff_mult": 2}
CORPUS = [
    "An image of a cat sitting on a mat. Output: a small grey cat on a red mat.",
    "Question: What is in the picture? Short answer: two dogs playing in the snow.",
    "the quick brown fox jumps over the lazy dog while the sun sets behind the hills.",
    "A photo of a kitchen with a table, four chairs and a bowl of green apples.",
    "Question: How many people are there? Short answer: three people near a bus stop.",
]


def log(*a):
    print("openflamingo_ref:", *a, file=sys.stderr)


# ---- building the tiny release ------------------------------------------------------------------
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # Like GPT-NeoX-20B's tokenizer: one <|endoftext|> for bos/eos/unk, no pad token.
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", unk_token="<|endoftext|>")


def tiny_lm(kind, args):
    # vocab 320 > tokenizer (300 + 3 added): the factory's resize shrinks it, as for the
    # releases (50432 -> 50280).
    if kind == "gpt_neox":
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
        cfg = GPTNeoXConfig(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                            intermediate_size=256, hidden_act="gelu", rotary_pct=args.rotary_pct,
                            rotary_emb_base=10000, max_position_embeddings=128, layer_norm_eps=1e-5,
                            use_parallel_residual=args.parallel_residual, tie_word_embeddings=False,
                            bos_token_id=0, eos_token_id=0)
        return GPTNeoXForCausalLM(cfg)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        # LLaMA-7B's structure (RMSNorm, SwiGLU, full-head RoPE, no biases, untied head) shrunk,
        # with grouped-query attention (LLaMA-2-70B / LLaMA-3 style) so the head mapping is tested.
        cfg = LlamaConfig(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=args.kv_heads, intermediate_size=96, hidden_act="silu",
                          max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                          attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                          bos_token_id=0, eos_token_id=0)
        return LlamaForCausalLM(cfg)
    if kind == "mpt":
        from transformers import MptConfig, MptForCausalLM
        # mpt-7b's settings; transformers' Mpt hardcodes no biases and has no qk LayerNorm.
        cfg = MptConfig(d_model=64, n_heads=4, n_layers=4, expansion_ratio=4, max_seq_len=128,
                        vocab_size=320, layer_norm_epsilon=1e-5, no_bias=True, learned_pos_emb=False,
                        attn_config={"alibi": True, "alibi_bias_max": 8, "qk_ln": False, "clip_qkv": None,
                                     "softmax_scale": None, "attn_pdrop": 0.0},
                        bos_token_id=0, eos_token_id=0)
        return MptForCausalLM(cfg)
    raise SystemExit(f"--lm {kind}: expected gpt_neox, mpt or llama")


def randomize(module, g, linear=True):
    """Weights init would leave at 0 or 1 (biases, LayerNorm/RMSNorm affine) and a usable scale for the LM
    (transformers' std 0.02 would make the tiny model nearly constant)."""
    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.LayerNorm):
                if m.weight is not None:
                    m.weight.copy_(normal(m.weight.shape, 0.2, 1.0))
                if m.bias is not None:
                    m.bias.copy_(normal(m.bias.shape, 0.1))
            elif type(m).__name__.endswith("RMSNorm"):  # transformers' LlamaRMSNorm (weight only)
                m.weight.copy_(normal(m.weight.shape, 0.2, 1.0))
            elif isinstance(m, torch.nn.Linear):
                if linear:
                    m.weight.copy_(normal(m.weight.shape, m.in_features ** -0.5))
                if m.bias is not None:
                    m.bias.copy_(normal(m.bias.shape, 0.1))
            elif isinstance(m, torch.nn.Embedding) and linear:
                m.weight.copy_(normal(m.weight.shape, 0.3))
            elif isinstance(m, torch.nn.MultiheadAttention) and m.in_proj_bias is not None:
                m.in_proj_bias.copy_(normal(m.in_proj_bias.shape, 0.1))


def filter_state_dict_to_trainable(model, state_dict):
    """open_flamingo/train/train_utils.py filter_state_dict_to_trainable (2.0.1), copied because
    that module imports wandb at the top."""
    for name, p in model.named_parameters():
        if "fsdp" in name:
            continue
        if "embed" in name or isinstance(p, torch.nn.Embedding):
            continue
        if not p.requires_grad:
            name = name.replace("._checkpoint_wrapped_module", "")
            if name in state_dict:
                del state_dict[name]
            else:
                print(f"WARNING: filtering but {name} not in state_dict")
    to_delete = [n for n in state_dict.keys()
                 if ("lang_encoder.old_decoder_blocks" in n) or ("lang_encoder.gated_cross_attn_layers" in n)
                 or ("vision_encoder" in n)]
    for name in to_delete:
        del state_dict[name]
    return state_dict


def make_release(rel, args):
    """Builds the tiny OpenFlamingo with the package; writes release files; returns the model."""
    import open_clip
    from open_flamingo import create_model_and_transforms
    from open_flamingo.src.helpers import PerceiverResampler
    from safetensors.torch import save_file
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    os.makedirs(rel, exist_ok=True)
    lm_dir = os.path.join(rel, "lm")
    lm = tiny_lm(args.lm, args)
    randomize(lm, g)
    lm.save_pretrained(lm_dir)
    tiny_tokenizer().save_pretrained(lm_dir)

    # openai CLIP style: QuickGELU, ln_pre, class token; head_width 16 -> 3 heads.
    vision_cfg = {"image_size": 28, "layers": 2, "width": 48, "patch_size": 14, "head_width": 16}
    if args.tokens_ln_post == "false":
        vision_cfg["final_ln_after_pool"] = True  # open_clip <= 2.22 behaviour: tokens before ln_post
    vit_name = f"lvxref-tiny-vit-{os.getpid()}-{id(args)}"
    vit_json = os.path.join(rel, "tiny-vit.json")
    with open(vit_json, "w") as f:
        json.dump({"embed_dim": 32, "quick_gelu": True, "vision_cfg": vision_cfg,
                   "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}},
                  f, indent=2)
    with tempfile.TemporaryDirectory() as d:  # register under a unique name (one registry per process)
        with open(os.path.join(d, vit_name + ".json"), "w") as f, open(vit_json) as src:
            f.write(src.read())
        open_clip.add_model_config(os.path.join(d, vit_name + ".json"))
    clip = open_clip.create_model(vit_name)
    randomize(clip, g, linear=False)
    clip_file = os.path.join(rel, "open_clip_model.safetensors")
    save_file({k: v.contiguous() for k, v in clip.state_dict().items()}, clip_file)

    model, _, tok = create_model_and_transforms(vit_name, clip_file, lm_dir, lm_dir,
                                                cross_attn_every_n_layers=2, use_local_files=True)
    if args.perceiver == "tiny":  # the factory hardcodes PerceiverResampler(dim=vis_dim)
        model.perceiver = PerceiverResampler(dim=model.vis_dim, **TINY_PERCEIVER)
        model.perceiver._use_gradient_checkpointing = False
    randomize(model.perceiver, g, linear=False)
    blocks = [b for b in model.lang_encoder.gated_cross_attn_layers if b is not None]
    for k, b in enumerate(blocks):
        randomize(b, g, linear=False)
        with torch.no_grad():  # tanh(gate) != 0, different per block
            b.attn_gate.fill_(0.5 + 0.25 * k)
            b.ff_gate.fill_(-0.7 + 0.2 * k)
    with torch.no_grad():  # "trained" embeddings differ from the LM directory's
        embeds = {model.lang_encoder.get_input_embeddings().weight, model.lang_encoder.get_output_embeddings().weight}
        if args.lm == "llama":  # lm_head has no "embed" in its name: filter_state_dict_to_trainable
            embeds = {model.lang_encoder.get_input_embeddings().weight}  # drops it, the LM dir's copy is used
        for e in embeds:
            e.add_(torch.randn(e.shape, generator=g) * 0.05)
    model.eval()
    ckpt = filter_state_dict_to_trainable(model, model.state_dict())
    torch.save(ckpt, os.path.join(rel, "checkpoint.pt"))
    return model, tok, {"lm": lm_dir, "vit_json": vit_json, "clip": clip_file,
                        "checkpoint": os.path.join(rel, "checkpoint.pt")}


def make_model(out, args):
    t0 = time.time()
    model, tok, files = make_release(os.path.join(out, "release"), args)
    perceiver_heads = TINY_PERCEIVER["heads"] if args.perceiver == "tiny" else 8
    conv.main(["--checkpoint", files["checkpoint"], "--lm", files["lm"], "--vision-config", files["vit_json"],
               "--vision-pretrained", files["clip"], "--cross-attn-every-n-layers", "2",
               "--perceiver-heads", str(perceiver_heads), "--out", out])
    log(f"make-model {args.lm}: {out} ({time.time() - t0:.1f} s)")
    return model


# ---- loading a converted directory into the package's modules ------------------------------------
def read_converted(out):
    from safetensors.torch import load_file
    idx = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        sd = {}
        for fn in files:
            sd.update(load_file(os.path.join(out, fn)))
        return sd
    return load_file(os.path.join(out, "model.safetensors"))


def build_from_converted(out):
    """A package Flamingo built from OUT_DIR/config.json with the converted tensors loaded."""
    import open_clip
    from open_flamingo import Flamingo
    from open_flamingo.src.flamingo_lm import FlamingoLMMixin
    from open_flamingo.src.helpers import GatedCrossAttentionBlock, PerceiverResampler
    from open_flamingo.src.utils import extend_instance
    from transformers import AutoConfig, AutoModelForCausalLM
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    vc, pc, xc = cfg["vision_config"], cfg["perceiver_config"], cfg["cross_attn_config"]
    if vc["act"] not in ("gelu", "quick_gelu"):
        raise SystemExit(f"vision act {vc['act']}: not rebuilt here")
    vision_cfg = {"image_size": vc["image_size"], "layers": vc["layers"], "width": vc["width"],
                  "patch_size": vc["patch_size"], "head_width": vc["head_width"], "mlp_ratio": vc["mlp_ratio"],
                  "no_ln_pre": not vc["ln_pre"], "final_ln_after_pool": not vc["tokens_ln_post"]}
    if vc["layer_scale"]:
        vision_cfg["ls_init_value"] = 1e-5
    name = f"lvxref-vit-{os.getpid()}-{abs(hash(os.path.abspath(out)))}"
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, name + ".json"), "w") as f:
            json.dump({"embed_dim": vc["output_dim"], "quick_gelu": vc["act"] == "quick_gelu",
                       "vision_cfg": vision_cfg,
                       "text_cfg": {"context_length": 4, "vocab_size": 8, "width": 8, "heads": 1, "layers": 1}}, f)
        open_clip.add_model_config(os.path.join(d, name + ".json"))
    logging.getLogger().setLevel(logging.ERROR)  # open_clip warns that no weights were loaded
    clip = open_clip.create_model(name)
    logging.getLogger().setLevel(logging.WARNING)
    clip.visual.output_tokens = True  # factory.py

    tc = dict(cfg["text_config"])
    lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(tc.pop("model_type"), **tc))
    extend_instance(lm, FlamingoLMMixin)
    lm.set_decoder_layers_attr_name(cfg["decoder_layers_attr"])
    if lm.get_input_embeddings().weight.shape[0] != cfg["vocab_size"]:
        # A release's LM vocabulary (MPT-1B: 50432) resized to its tokenizer's, as the factory
        # does (create_model_and_transforms: resize_token_embeddings(len(tokenizer))).
        lm.resize_token_embeddings(cfg["vocab_size"])
    assert lm.get_input_embeddings().weight.shape[0] == cfg["vocab_size"]
    model = Flamingo(clip, lm, cfg["endofchunk_token_id"], cfg["media_token_id"], vis_dim=vc["width"],
                     cross_attn_every_n_layers=cfg["cross_attn_every_n_layers"])
    model.perceiver = PerceiverResampler(dim=pc["dim"], depth=pc["depth"], dim_head=pc["dim_head"],
                                         heads=pc["heads"], num_latents=pc["num_latents"], ff_mult=pc["ff_mult"],
                                         max_num_media=pc["max_num_media"], max_num_frames=pc["max_num_frames"])
    lm.gated_cross_attn_layers = torch.nn.ModuleList([
        GatedCrossAttentionBlock(dim=xc["dim"], dim_visual=xc["dim_visual"], dim_head=xc["dim_head"],
                                 heads=xc["heads"], ff_mult=xc["ff_mult"],
                                 only_attend_immediate_media=xc["only_attend_immediate_media"])
        if i in cfg["cross_attn_layers"] else None for i in range(cfg["num_decoder_layers"])])
    lm.init_flamingo_layers(False)

    sd = read_converted(out)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed = conv.DUPLICATE_PREFIXES
    tied = {"lang_encoder." + n for n in ("lm_head.weight", "embed_out.weight")} if cfg["tie_word_embeddings"] else set()
    bad = [k for k in missing if not k.startswith(allowed) and k not in tied]
    if unexpected or bad:
        raise SystemExit(f"converted tensors do not fit the package model: missing {bad[:5]}, unexpected {unexpected[:5]}")
    model.eval()
    return model, cfg, sd


def encode_vision_x_with_grad(self, vision_x):
    """Flamingo._encode_vision_x (flamingo.py) without its torch.no_grad(), for vision grads."""
    from einops import rearrange
    b, T, F = vision_x.shape[:3]
    assert F == 1, "Only single frame supported"
    vision_x = rearrange(vision_x, "b T F c h w -> (b T F) c h w")
    vision_x = self.vision_encoder(vision_x)[1]
    vision_x = rearrange(vision_x, "(b T F) v d -> b T F v d", b=b, T=T, F=F)
    vision_x = self.perceiver(vision_x)
    for layer in self.lang_encoder._get_decoder_layers():
        layer.condition_vis_x(vision_x)


def vision_x_of(batch):
    px, counts = batch["pixel_values"], batch["images_per_sample"]
    B = batch["input_ids"].shape[0]
    if not bool((counts == counts[0]).all()):
        raise SystemExit("the package needs the same number of images in every sample (vision_x [B, T_img, 1, C, H, W])")
    T = int(counts[0])
    assert px.shape[0] == B * T
    return px.view(B, T, 1, *px.shape[1:])


@contextlib.contextmanager
def default_dtype(dtype):
    """transformers' MPT builds its causal mask with torch.full(finfo(dtype).min) in the default
    dtype, which overflows for float64 unless the default is float64 too."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def forward(model, batch, dtype):
    vx = vision_x_of(batch).to(dtype)
    ids = batch["input_ids"]
    with default_dtype(dtype):
        return model(vx, ids, attention_mask=torch.ones_like(ids)).logits


# ---- batches ---------------------------------------------------------------------------------------
def make_batch(cfg, seed, B, L, T):
    g = torch.Generator().manual_seed(seed)
    media, eoc, pad = cfg["media_token_id"], cfg["endofchunk_token_id"], cfg["pad_token_id"]
    eos = cfg["text_config"].get("eos_token_id") or 0  # null in the releases' MPT config
    pool = torch.tensor([i for i in range(cfg["vocab_size"]) if i not in (media, eoc, pad, eos)])

    def text(n):
        return pool[torch.randint(len(pool), (n,), generator=g)].tolist()

    rows = []
    for _ in range(B):
        pre = int(torch.randint(1, 4, (), generator=g))
        fixed = pre + 3 * T + 1
        if L < fixed:
            raise SystemExit(f"--length {L}: too short for {T} images (needs >= {fixed})")
        extra = torch.bincount(torch.randint(T, (L - fixed,), generator=g), minlength=T).tolist() if L > fixed else [0] * T
        ids = text(pre)
        for k in range(T):
            ids += [media] + text(1 + extra[k]) + [eoc]
        rows.append(ids + [eos])
    input_ids = torch.tensor(rows, dtype=torch.int64)
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:]
    labels[labels == media] = -100
    labels[torch.rand(labels.shape, generator=g) < 0.15] = -100
    H = cfg["vision_config"]["image_size"]
    H, W = (H, H) if isinstance(H, int) else H
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "pixel_values": torch.randn(B * T, 3, H, W, generator=g),
            "images_per_sample": torch.full((B,), T, dtype=torch.int64), "labels": labels}


# ---- an independent plain-torch forward from the converted files (the facts lvx implements) ------
def _spec_layers(w):
    """ln, lin and rms over the float64 converted tensors w, each found by its name prefix."""
    F = torch.nn.functional

    def ln(x, p, eps=1e-5):  # weight/bias by prefix; a missing bias (MPT) is no bias
        return F.layer_norm(x, x.shape[-1:], w[p + ".weight"], w.get(p + ".bias"), eps)

    def lin(x, p, bias=True):
        return F.linear(x, w[p + ".weight"], w.get(p + ".bias") if bias else None)

    def rms(t, p, eps):  # LlamaRMSNorm: statistics in float32 whatever the model dtype, then weight
        h = t.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w[p + ".weight"] * h.to(t.dtype)

    return ln, lin, rms


def _attend(q, k, v, bias=None):
    """Softmax attention, [.., H, Lq, d] x [.., H, Lk, d]; q already scaled."""
    s = q @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias
    return torch.softmax(s, -1) @ v


def _heads(t, h):
    """[..., L, h * d] -> [..., h, L, d], heads contiguous."""
    return t.view(*t.shape[:-1], h, -1).transpose(-2, -3)


def _rope(t, r):
    """[B, H, L, hd]: rotate the first r.rot dims, halves (x1, x2) -> (-x2, x1)."""
    rot, cos, sin = r.rot, r.cos, r.sin
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = x[..., : rot // 2], x[..., rot // 2:]
    return torch.cat([x * cos + torch.cat([-x2, x1], -1) * sin, rest], -1)


def _spec_vision(w, vc, pixel_values):
    """The open_clip ViT's tokens [N_img, n_tok, W] (class token dropped)."""
    F = torch.nn.functional
    ln, lin, _ = _spec_layers(w)
    # open_clip ViT: conv patches (no bias), class token first, learned positions, ln_pre, pre-LN
    # blocks with nn.MultiheadAttention (in_proj rows q|k|v, heads contiguous), QuickGELU or GELU
    px = pixel_values.double()
    x = F.conv2d(px, w["vision_encoder.conv1.weight"], stride=vc["patch_size"])
    x = x.flatten(2).transpose(1, 2)  # patches row-major
    N, _, Wd = x.shape
    x = torch.cat([w["vision_encoder.class_embedding"].expand(N, 1, Wd), x], 1) + w["vision_encoder.positional_embedding"]
    if vc["ln_pre"]:
        x = ln(x, "vision_encoder.ln_pre", vc["norm_eps"])
    Hv = vc["heads"]
    act = (lambda t: t * torch.sigmoid(1.702 * t)) if vc["act"] == "quick_gelu" else F.gelu
    for j in range(vc["layers"]):
        p = f"vision_encoder.transformer.resblocks.{j}."
        h = ln(x, p + "ln_1", vc["norm_eps"])
        q, k, v = F.linear(h, w[p + "attn.in_proj_weight"], w[p + "attn.in_proj_bias"]).chunk(3, -1)
        q, k, v = (t.view(N, -1, Hv, Wd // Hv).transpose(1, 2) for t in (q, k, v))
        o = _attend(q * (Wd // Hv) ** -0.5, k, v).transpose(1, 2).reshape(N, -1, Wd)
        x = x + lin(o, p + "attn.out_proj")
        x = x + lin(act(lin(ln(x, p + "ln_2", vc["norm_eps"]), p + "mlp.c_fc")), p + "mlp.c_proj")
    if vc["tokens_ln_post"]:
        x = ln(x, "vision_encoder.ln_post", vc["norm_eps"])
    return x[:, 1:]


def _spec_perceiver(w, pc, tokens, B, T):
    """The perceiver's output [B, T, n_latents, W] from the vision tokens."""
    F = torch.nn.functional
    ln, lin, _ = _spec_layers(w)
    # perceiver: latents attend to concat(norm_media(x), norm_latents(latents)); residual; FF; norm
    Wd = tokens.shape[-1]
    xm = tokens.reshape(B, T, -1, Wd)
    lat = w["perceiver.latents"].expand(B, T, -1, -1)
    hp, dp = pc["heads"], pc["dim_head"]
    for l in range(pc["depth"]):
        p = f"perceiver.layers.{l}."
        xn, ln_ = ln(xm, p + "0.norm_media"), ln(lat, p + "0.norm_latents")
        q = lin(ln_, p + "0.to_q")
        k, v = lin(torch.cat([xn, ln_], -2), p + "0.to_kv").chunk(2, -1)
        o = _attend(_heads(q, hp) * dp ** -0.5, _heads(k, hp), _heads(v, hp))
        lat = lin(o.transpose(-2, -3).reshape(*lat.shape[:-1], hp * dp), p + "0.to_out") + lat
        lat = lin(F.gelu(lin(ln(lat, p + "1.0"), p + "1.1")), p + "1.3") + lat
    return ln(lat, "perceiver.norm")  # [B, T, n_lat, W]


def _spec_media_keys(cfg, ids, media, B, T):
    """What the gated blocks read: text_time, the visible mask and the media keys mk."""
    text_time = (ids == cfg["media_token_id"]).cumsum(-1)  # [B, L]: 1-based image index, 0 before any
    n_lat = media.shape[2]
    key_img = torch.arange(T).repeat_interleave(n_lat) + 1  # [T * n_lat]
    visible = text_time[:, None, :, None] == key_img[None, None, None, :]  # [B, 1, L, T*n]
    mk = media.reshape(B, T * n_lat, -1)
    return types.SimpleNamespace(text_time=text_time, visible=visible, mk=mk)


def _spec_positions(tc, kind, D, L):
    """The LM's head counts and position tables (rotary cos/sin or ALiBi) and the causal mask bias."""
    import math
    F = torch.nn.functional
    Hkv = rot = cos = sin = lact = alibi = None
    pos = torch.arange(L, dtype=torch.float64)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    if kind == "gpt_neox":
        H = tc["num_attention_heads"]
        hd = D // H
        rot = int(hd * tc["rotary_pct"])
        inv = 1.0 / (tc["rotary_emb_base"] ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
        ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)  # [L, rot]
        cos, sin = ang.cos(), ang.sin()
    elif kind == "llama":
        if tc.get("rope_scaling") or tc.get("partial_rotary_factor", 1.0) != 1.0:
            raise SystemExit("spec_forward: llama rope_scaling / partial_rotary_factor not written here")
        H = tc["num_attention_heads"]
        Hkv = tc.get("num_key_value_heads") or H
        hd = tc.get("head_dim") or D // H
        rot = hd  # rotary over the whole head
        # inv_freq as transformers computes it (_compute_default_rope_parameters): float32
        inv = (1.0 / (tc["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))).double()
        ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)  # [L, hd]
        cos, sin = ang.cos(), ang.sin()
        acts = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu,
                "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}
        if tc["hidden_act"] not in acts:
            raise SystemExit(f"spec_forward: llama hidden_act {tc['hidden_act']} not written here")
        lact = acts[tc["hidden_act"]]
    else:
        H = tc["n_heads"]
        hd = D // H
        n2 = 2 ** math.ceil(math.log2(H))
        slopes = 1.0 / 2 ** (torch.arange(1, n2 + 1, dtype=torch.float64) * (tc["attn_config"]["alibi_bias_max"] / n2))
        if n2 != H:
            slopes = torch.cat([slopes[1::2], slopes[::2]])[:H]
        alibi = slopes[:, None, None] * (torch.arange(L, dtype=torch.float64) - (L - 1))[None, None, :]  # [H, 1, L]
    mask_bias = torch.zeros(L, L, dtype=torch.float64).masked_fill(~causal, float("-inf"))
    return types.SimpleNamespace(H=H, Hkv=Hkv, hd=hd, rot=rot, cos=cos, sin=sin, lact=lact,
                                 alibi=alibi, mask_bias=mask_bias)


def _spec_gated_block(w, x, p, xc, m, B, L):
    """One gated cross-attention block (tanh-gated attention to the visible media, then FF)."""
    F = torch.nn.functional
    ln, lin, _ = _spec_layers(w)
    hx, dx = xc["heads"], xc["dim_head"]
    q = _heads(lin(ln(x, p + "attn.norm"), p + "attn.to_q"), hx) * dx ** -0.5
    k, v = (_heads(t, hx) for t in lin(m.mk, p + "attn.to_kv").chunk(2, -1))
    s = (q @ k.transpose(-1, -2)).masked_fill(~m.visible, -torch.finfo(torch.float64).max)
    a = torch.softmax(s, -1).masked_fill((m.text_time == 0)[:, None, :, None], 0.0)
    o = lin((a @ v).transpose(1, 2).reshape(B, L, hx * dx), p + "attn.to_out")
    x = x + o * torch.tanh(w[p + "attn_gate"])
    x = x + lin(F.gelu(lin(ln(x, p + "ff.0"), p + "ff.1")), p + "ff.3") * torch.tanh(w[p + "ff_gate"])
    return x


def _spec_gpt_neox_layer(w, x, p, tc, r, B, L, D):
    """One GPT-NeoX decoder layer (fused per-head qkv, partial rotary, optional parallel residual)."""
    F = torch.nn.functional
    ln, lin, _ = _spec_layers(w)
    H, hd = r.H, r.hd
    eps = tc["layer_norm_eps"]
    qkv = lin(ln(x, p + "input_layernorm", eps), p + "attention.query_key_value")
    qkv = qkv.view(B, L, H, 3 * hd).transpose(1, 2)  # per head: [q | k | v]
    q, k, v = qkv.split(hd, -1)
    o = _attend(_rope(q, r) * hd ** -0.5, _rope(k, r), v, r.mask_bias).transpose(1, 2).reshape(B, L, D)
    attn = lin(o, p + "attention.dense")

    def mlp(t):
        return lin(F.gelu(lin(t, p + "mlp.dense_h_to_4h")), p + "mlp.dense_4h_to_h")
    if tc["use_parallel_residual"]:
        x = x + attn + mlp(ln(x, p + "post_attention_layernorm", eps))
    else:
        x = x + attn
        x = x + mlp(ln(x, p + "post_attention_layernorm", eps))
    return x


def _spec_llama_layer(w, x, p, tc, r, B, L, D):
    """One LLaMA decoder layer (RMSNorm, GQA, rotary over the whole head, gated MLP)."""
    _, lin, rms = _spec_layers(w)
    H, Hkv, hd = r.H, r.Hkv, r.hd
    eps = tc["rms_norm_eps"]
    h = rms(x, p + "input_layernorm", eps)
    q = _heads(lin(h, p + "self_attn.q_proj"), H)  # [B, H, L, hd], heads contiguous
    k, v = (_heads(lin(h, p + "self_attn." + n), Hkv) for n in ("k_proj", "v_proj"))
    # GQA (repeat_kv): query head j uses kv head j // (H / Hkv)
    k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    o = _attend(_rope(q, r) * hd ** -0.5, _rope(k, r), v, r.mask_bias).transpose(1, 2).reshape(B, L, H * hd)
    x = x + lin(o, p + "self_attn.o_proj")
    h = rms(x, p + "post_attention_layernorm", eps)
    x = x + lin(r.lact(lin(h, p + "mlp.gate_proj")) * lin(h, p + "mlp.up_proj"), p + "mlp.down_proj")
    return x


def _spec_mpt_layer(w, x, p, tc, r, B, L, D):
    """One MPT decoder layer (fused Wqkv, ALiBi, no rotary)."""
    F = torch.nn.functional
    ln, lin, _ = _spec_layers(w)
    H, hd = r.H, r.hd
    eps = tc["layer_norm_epsilon"]
    q, k, v = (_heads(t, H) for t in lin(ln(x, p + "norm_1", eps), p + "attn.Wqkv").chunk(3, -1))
    o = _attend(q * hd ** -0.5, k, v, r.alibi + r.mask_bias).transpose(1, 2).reshape(B, L, D)
    x = x + lin(o, p + "attn.out_proj")
    x = x + lin(F.gelu(lin(ln(x, p + "norm_2", eps), p + "ffn.up_proj")), p + "ffn.down_proj")
    return x


def _spec_logits(w, x, cfg, tc, kind, emb):
    """The LM's final norm and head: logits [B, L, V]."""
    F = torch.nn.functional
    ln, lin, rms = _spec_layers(w)
    if kind == "gpt_neox":
        x = ln(x, "lang_encoder.gpt_neox.final_layer_norm", tc["layer_norm_eps"])
        logits = lin(x, "lang_encoder.embed_out")
    elif kind == "llama":
        x = rms(x, "lang_encoder.model.norm", tc["rms_norm_eps"])
        logits = F.linear(x, emb) if cfg["tie_word_embeddings"] else lin(x, "lang_encoder.lm_head")
    else:
        x = ln(x, "lang_encoder.transformer.norm_f", tc["layer_norm_epsilon"])
        logits = F.linear(x, emb)
    return logits


def spec_forward(cfg, sd, batch):
    """Logits [B, L, V], vision tokens and perceiver output in float64 from config.json and the
    converted tensors alone, written from the package code's math without its modules."""
    w = {k: v.double() for k, v in sd.items()}
    vc, pc, xc, tc = cfg["vision_config"], cfg["perceiver_config"], cfg["cross_attn_config"], cfg["text_config"]
    tokens = _spec_vision(w, vc, batch["pixel_values"])
    N = tokens.shape[0]
    B, L = batch["input_ids"].shape
    T = N // B
    media = _spec_perceiver(w, pc, tokens, B, T)

    # language model with gated cross-attention blocks before the decoder layers that have one
    ids = batch["input_ids"]
    attr = cfg["decoder_layers_attr"]
    kind = tc["model_type"]
    emb = w["lang_encoder." + {"gpt_neox": "gpt_neox.embed_in.weight", "mpt": "transformer.wte.weight",
                               "llama": "model.embed_tokens.weight"}[kind]]
    x = emb[ids]
    D = x.shape[-1]
    m = _spec_media_keys(cfg, ids, media, B, T)
    r = _spec_positions(tc, kind, D, L)
    layer = {"gpt_neox": _spec_gpt_neox_layer, "llama": _spec_llama_layer}.get(kind, _spec_mpt_layer)
    for i in range(cfg["num_decoder_layers"]):
        if i in cfg["cross_attn_layers"]:
            x = _spec_gated_block(w, x, f"lang_encoder.{attr}.{i}.gated_cross_attn_layer.", xc, m, B, L)
        x = layer(w, x, f"lang_encoder.{attr}.{i}.decoder_layer.", tc, r, B, L, D)
    return _spec_logits(w, x, cfg, tc, kind, emb), tokens, media


# ---- run -------------------------------------------------------------------------------------------
def run(out, batch_path, expected_path, backward, dtype):
    from safetensors.torch import load_file, save_file
    model, cfg, sd = build_from_converted(out)
    model.to(dtype)
    batch = load_file(batch_path)
    result, hooks = {}, []
    captured = {}
    hooks.append(model.vision_encoder.register_forward_hook(lambda m, i, o: captured.__setitem__("vision_tokens", o[1])))
    hooks.append(model.perceiver.register_forward_hook(lambda m, i, o: captured.__setitem__("media", o)))
    for i, layer in enumerate(model.lang_encoder._get_decoder_layers()):
        if layer.gated_cross_attn_layer is not None:
            hooks.append(layer.gated_cross_attn_layer.register_forward_hook(
                lambda m, i_, o, i=i: captured.__setitem__(f"xattn_out.{i}", o)))
    if backward:
        model.requires_grad_(True)
        model._encode_vision_x = types.MethodType(encode_vision_x_with_grad, model)
        logits = forward(model, batch, dtype)
        labels = batch["labels"]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(torch.float64),
                                                 labels.reshape(-1), ignore_index=-100, reduction="mean")
        loss.backward()
        result["loss"] = loss.detach().float().reshape(())
        params = dict(model.named_parameters(remove_duplicate=False))
        for name in sd:
            p = params[name]
            result["grad." + name] = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().contiguous()
    else:
        with torch.no_grad():
            logits = forward(model, batch, dtype)
    result["logits"] = logits.detach().float().contiguous()
    for k, v in captured.items():
        result["intermediate." + k] = v.detach().float().contiguous()
    for h in hooks:
        h.remove()
    save_file(result, expected_path)
    log(f"run: wrote {expected_path} ({len(result)} tensors)")


# ---- generate --------------------------------------------------------------------------------------
def generate(out, batch_path, expected_path, steps):
    from safetensors.torch import load_file, save_file
    model, cfg, _ = build_from_converted(out)
    model.to(torch.float64)
    batch = load_file(batch_path)
    ids = batch["input_ids"]
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            last = forward(model, dict(batch, input_ids=ids), torch.float64)[:, -1]  # [B, V]
            nxt = last.argmax(-1)  # the first (lowest) id on ties
            if bool((nxt == cfg["media_token_id"]).any()):
                raise SystemExit(f"generate: step {len(tokens)} chose <image> ({cfg['media_token_id']}); "
                                 "pick another seed")
            tokens.append(nxt)
            logits.append(last)
            ids = torch.cat([ids, nxt[:, None]], 1)
    step_logits = torch.stack(logits, 1)
    top2 = step_logits.topk(2, dim=-1).values
    save_file({"tokens": torch.stack(tokens, 1).contiguous(),
               "step_logits": step_logits.float().contiguous()}, expected_path)
    log(f"generate: wrote {expected_path}: tokens {torch.stack(tokens, 1).tolist()}, "
        f"smallest top-2 margin {float((top2[..., 0] - top2[..., 1]).min()):.3g}")


# ---- selfcheck -------------------------------------------------------------------------------------
def first_image_pos(ids, media):
    return [int((row == media).nonzero()[0]) for row in ids]


def selfcheck_one(out, kind, seed, full=True, **variant):
    args = argparse.Namespace(lm=kind, seed=seed, rotary_pct=1.0, parallel_residual=False,
                              tokens_ln_post="auto", perceiver="tiny", kv_heads=2)
    vars(args).update(variant)
    original = make_model(out, args)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    batch = make_batch(cfg, seed + 1, 2, 24, 3)
    fresh, cfg, sd = build_from_converted(out)

    # 1. key set: the package's state dict without its aliases (and the tied head), no duplicates
    want = {k for k in original.state_dict() if not k.startswith(conv.DUPLICATE_PREFIXES)}
    if cfg["tie_word_embeddings"]:
        want.discard("lang_encoder.lm_head.weight")
    assert set(sd) == want, f"key sets differ: {sorted(set(sd) ^ want)[:6]}"
    osd = original.state_dict()
    for k, v in sd.items():
        assert torch.equal(v, osd[k]), f"{k} differs from the original model"
    # 2. identical logits
    with torch.no_grad():
        a, b = forward(original, batch, torch.float32), forward(fresh, batch, torch.float32)
    assert torch.equal(a, b), f"logits differ after conversion: {(a - b).abs().max()}"

    fresh.double()
    # 3. the plain-torch spec (spec_forward) agrees with the package in float64
    with torch.no_grad():
        base = forward(fresh, batch, torch.float64)
        ref, _, _ = spec_forward(cfg, sd, batch)
    err = float((ref - base).abs().max())
    assert err < 1e-5 * max(1.0, float(base.abs().max())), f"spec_forward differs from the package: {err}"
    what = f"spec err {err:.1e}"
    if not full:
        log(f"selfcheck {kind} {variant}: ok (keys {len(sd)}, logits identical after conversion, {what})")
        return
    blocks = [l.gated_cross_attn_layer for l in fresh.lang_encoder._get_decoder_layers()
              if l.gated_cross_attn_layer is not None]
    with torch.no_grad():
        # 4. gates at 0: the base LM on the converted LM tensors
        from transformers import AutoConfig, AutoModelForCausalLM
        tc = dict(cfg["text_config"])
        lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(tc.pop("model_type"), **tc)).double().eval()
        attr = cfg["decoder_layers_attr"]
        lm_sd = {k[len("lang_encoder."):].replace(".decoder_layer.", "."): v for k, v in sd.items()
                 if k.startswith("lang_encoder.") and ".gated_cross_attn_layer." not in k}
        missing, unexpected = lm.load_state_dict(lm_sd, strict=False)
        assert not unexpected and all(m in ("lm_head.weight",) for m in missing), (missing, unexpected)
        saved = [(b.attn_gate.clone(), b.ff_gate.clone()) for b in blocks]
        for blk in blocks:
            blk.attn_gate.zero_()
            blk.ff_gate.zero_()
        zero = forward(fresh, batch, torch.float64)
        with default_dtype(torch.float64):
            plain = lm(batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"])).logits
        assert torch.allclose(zero, plain, atol=1e-10, rtol=0), f"gates 0 != base LM: {(zero - plain).abs().max()}"
        assert (zero - base).abs().max() > 1e-3, "the gated blocks do not change the logits"
        for blk, (ag, fg) in zip(blocks, saved):
            blk.attn_gate.copy_(ag)
            blk.ff_gate.copy_(fg)
        # 5. attn_gate and pixels matter exactly from the first <image> on
        firsts = first_image_pos(batch["input_ids"], cfg["media_token_id"])
        blocks[0].attn_gate.add_(0.3)
        pert = forward(fresh, batch, torch.float64)
        blocks[0].attn_gate.sub_(0.3)
        px = dict(batch, pixel_values=batch["pixel_values"] + 0.5)
        pert_px = forward(fresh, px, torch.float64)
        for name, p in (("attn_gate", pert), ("pixels", pert_px)):
            d = (p - base).abs().amax(-1)
            for s, f in enumerate(firsts):
                assert f >= 1
                assert float(d[s, :f].max()) == 0.0, f"{name}: tokens before the first <image> changed"
                assert float(d[s, f:].min()) > 1e-9, f"{name}: a token after the first <image> did not change"
    log(f"selfcheck {kind}: ok (keys {len(sd)}, logits identical after conversion, {what}, gates-0 == base LM, "
        f"attn_gate/pixels change exactly the tokens from the first <image> on {firsts})")


# ---- command line ----------------------------------------------------------------------------------
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("out")
    m.add_argument("--lm", required=True, choices=("gpt_neox", "mpt", "llama"))
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--rotary-pct", type=float, default=1.0, help="GPT-NeoX rotary_pct (RedPajama-3B: 1.0)")
    m.add_argument("--parallel-residual", action="store_true", help="GPT-NeoX use_parallel_residual")
    m.add_argument("--kv-heads", type=int, default=2, help="LLaMA num_key_value_heads (4 heads; 4 = MHA, 1 = MQA)")
    m.add_argument("--tokens-ln-post", choices=("auto", "false"), default="auto",
                   help="false: open_clip final_ln_after_pool=True, the tokens before ln_post")
    m.add_argument("--perceiver", choices=("tiny", "default"), default="tiny")
    b = sub.add_parser("make-batch")
    b.add_argument("out")
    b.add_argument("batch_file", metavar="BATCH.safetensors")
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--batch", type=int, default=2)
    b.add_argument("--length", type=int, default=32)
    b.add_argument("--images", type=int, default=3)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("batch")
    r.add_argument("expected")
    r.add_argument("--backward", action="store_true")
    r.add_argument("--float32", action="store_true")
    gp = sub.add_parser("generate")
    gp.add_argument("out")
    gp.add_argument("batch")
    gp.add_argument("expected")
    gp.add_argument("--tokens", type=int, required=True)
    s = sub.add_parser("selfcheck")
    s.add_argument("out")
    s.add_argument("--lm", choices=("gpt_neox", "mpt", "llama", "all"), default="all")
    s.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if a.cmd == "make-model":
        make_model(a.out, a)
    elif a.cmd == "make-batch":
        from safetensors.torch import save_file
        with open(os.path.join(a.out, "config.json")) as f:
            cfg = json.load(f)
        save_file(make_batch(cfg, a.seed, a.batch, a.length, a.images), a.batch_file)
    elif a.cmd == "run":
        run(a.out, a.batch, a.expected, a.backward, torch.float32 if a.float32 else torch.float64)
    elif a.cmd == "generate":
        generate(a.out, a.batch, a.expected, a.tokens)
    else:
        if a.lm in ("gpt_neox", "all"):  # RedPajama-INCITE-3B's settings, then the other branches
            selfcheck_one(os.path.join(a.out, "gpt_neox"), "gpt_neox", a.seed)
            selfcheck_one(os.path.join(a.out, "gpt_neox-variant"), "gpt_neox", a.seed + 7, full=False,
                          rotary_pct=0.25, parallel_residual=True, tokens_ln_post="false", perceiver="default")
        if a.lm in ("mpt", "all"):
            selfcheck_one(os.path.join(a.out, "mpt"), "mpt", a.seed)
            selfcheck_one(os.path.join(a.out, "mpt-variant"), "mpt", a.seed + 7, full=False,
                          tokens_ln_post="false")
        if a.lm in ("llama", "all"):  # GQA 4 -> 2 heads, then multi-query attention
            selfcheck_one(os.path.join(a.out, "llama"), "llama", a.seed)
            selfcheck_one(os.path.join(a.out, "llama-variant"), "llama", a.seed + 7, full=False,
                          kv_heads=1, tokens_ln_post="false")


if __name__ == "__main__":
    main()
