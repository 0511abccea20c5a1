"""Reference for lvx's Llama-3.2-Vision (Mllama) family: transformers' own MllamaForConditionalGeneration.

usage:
  mllama_ref.py make-model OUT_DIR [--seed S] [--dtype fp32|bf16]
  mllama_ref.py make-batch OUT_DIR BATCH.safetensors [--seed S] [--length L] [--one-image]
  mllama_ref.py run OUT_DIR BATCH.safetensors EXPECTED.safetensors [--backward] [--intermediates]
                [--float32]
  mllama_ref.py generate OUT_DIR BATCH.safetensors EXPECTED.safetensors --tokens N
  mllama_ref.py selfcheck [--workdir DIR]

Unlike the mPLUG-Owl3 and OpenFlamingo references (written from the spec), the forward here IS
transformers 4.57.3's MllamaForConditionalGeneration (models/mllama/modeling_mllama.py): this
script only makes a tiny random checkpoint, a batch as MllamaProcessor lays it out, and runs the
model.

make-model writes a TINY random checkpoint with MllamaForConditionalGeneration.save_pretrained
(safe_serialization): config.json (model_type "mllama", text_config, vision_config,
image_token_index), model.safetensors, generation_config.json, plus tokenizer.json. save_pretrained
in 4.57.3 reverses the class's _checkpoint_conversion_mapping, so the file holds the RELEASED
on-disk layout (language_model.model.layers.N.cross_attn.*, language_model.model.layers.N.
cross_attn_attn_gate, language_model.lm_head.weight, vision_model.*, multi_modal_projector.*), not
the in-memory names (model.language_model.*, lm_head.*); make-model asserts this.
Sizes: text hidden 64, 5 layers, cross_attention_layers [1, 3], 4 heads, 2 KV heads (head_dim 16),
MLP 96, rope_theta 5e5 with llama3 rope_scaling (factor 8, low 1, high 4, original 64: at head_dim
16 frequency 0 is kept, 1 interpolated, 2..7 divided by 8); vocab_size V = the tokenizer's ids
without <|image|>; <|image|> = V (image_token_index, an embed_tokens row of the + 8, as released:
128256); vision hidden 32, 2 local layers + 1 global, 2 heads, MLP 48, image 16, patch 4 (16
patches + class = 17 tokens per tile, padded to 24 inside the encoder), max_num_tiles 2,
supported_aspect_ratios [[1,1],[1,2],[2,1]], intermediate_layers_indices [0, 1] -> vision_output_dim
32 * (1 + 2) = 96.
Weights: transformers' init (std 0.02) makes every branch vanish, so every tensor is redrawn from a
torch.Generator(seed) in key order: matrices N(0, 1/fan_in), norm weights 1 + N(0, 0.1^2), biases
N(0, 0.1^2), embeddings N(0, 1), class/positional embeddings N(0, 0.5^2), tile embeddings
N(0, 0.5^2), every gate (cross_attn_attn_gate, cross_attn_mlp_gate, the vision's positional and
tile gates, global layers' gate_attn/gate_ffn) U(0.3, 1.0) (HF initialises the text gates to 0,
which would make the cross layers invisible).
Tokenizer: byte-level BPE (~300 ids) trained on a built-in corpus with Llama 3's split regex, no
normalizer, ByteLevel post-processor and decoder; added special tokens <|begin_of_text|>,
<|end_of_text|>, <|start_header_id|>, <|end_header_id|>, <|eot_id|> (ids V-5..V-1) and <|image|> (V).

make-batch (tiles and aspect ratios from config.json's vision_config; --one-image: one sample,
one square image, for release-sized models) writes BATCH.safetensors as MllamaProcessor lays a
batch out (B = 2, L tokens, no
padding): input_ids int64 [B, L]; pixel_values float32 [B, 3, 2, 3, 16, 16] (images, tiles; padding
images and tiles zero); aspect_ratio_ids int64 [B, 3] (0 for padding images); aspect_ratio_mask
int64 [B, 3, 2] (tile 0 always 1, as build_aspect_ratio_mask does); cross_attention_mask int64
[B, L, 3, 2] from processing_mllama's get_cross_attention_token_mask +
convert_sparse_cross_attention_mask_to_dense; labels int64 [B, L] (lvx's convention: NOT shifted,
position t's logits predict labels[t]; -100 ignored). Sample 0: text, a group of two consecutive
<|image|> (aspect ratios (1,2) and (1,1)), text, a third <|image|> ((2,1)), text; sample 1: text,
one <|image|> ((1,1)), text, and two padding images. Text before the first image exercises HF's
all-keys quirk (a row with an all-zero mask attends to every key, padding included; only its MLP
branch is zeroed).

run writes EXPECTED.safetensors: logits float32 [B, L, V]; with --backward loss (float32 0-dim,
mean CE over labels != -100, computed here from the logits: lvx's unshifted convention) and
grad.<on-disk name> float32 for EVERY tensor of model.safetensors. With --intermediates also
vision_output [B*3, 2*17, 96] (MllamaVisionModel's output, images flattened sample-major),
cross_attention_states [B*3, 2*17, 64] (after multi_modal_projector), hidden.<i> [B, L, 64] (decoder
layer i's output) and rope_inv_freq [8] (the model's fp32 rotary inv_freq buffer).

generate writes tokens int64 [B, N] and step_logits float32 [B, N, V]: greedy decoding WITHOUT a
cache, each step the whole forward on the prompt plus the tokens so far; the new tokens' rows of
cross_attention_mask repeat the last row (MllamaForConditionalGeneration.
_update_model_kwargs_for_generation); argmax (lowest id on ties) of the last position's logits.

PRECISION: the model runs in float64 (checkpoint read as stored, .double()) with
attn_implementation "sdpa": transformers' "eager" attention takes the softmax in fp32 even for a
float64 model, which would make the reference only fp32-exact; fp64 SDPA on the CPU is the math
kernel in fp64 with the same additive masks. selfcheck shows eager and sdpa agree to ~1e-7.
Outputs are written as float32.
"""
import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
IMAGE_TOKEN = "<|image|>"
# Llama 3's tokenizer.json Split pattern
LLAMA3_PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
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
    "Summarize the video in one sentence. A cooking show about making pasta at home.",
    "user: look at these frames and tell me what changed between them.",
    "assistant: the light turned green and the people started to cross the street.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 2024 and symbols ( ) [ ] { } , . ; : ! ? - _ / \\ \" ' @ #",
    "Ünïcödé wörds: café, naïve, façade; 中文 视频 图像; text with tabs\tand\nnewlines.",
]
MAX_TILES = 2
ASPECT_RATIOS = [[1, 1], [1, 2], [2, 1]]


def build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=300, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS + [IMAGE_TOKEN]])
    return tok


def tiny_config(tok):
    from transformers import MllamaConfig
    image_id = tok.token_to_id(IMAGE_TOKEN)
    assert image_id == tok.get_vocab_size() - 1
    text = dict(vocab_size=image_id, hidden_size=64, num_hidden_layers=5, cross_attention_layers=[1, 3],
                num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64},
                rms_norm_eps=1e-5, max_position_embeddings=512, bos_token_id=tok.token_to_id("<|begin_of_text|>"),
                eos_token_id=tok.token_to_id("<|end_of_text|>"), pad_token_id=None, tie_word_embeddings=False)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_global_layers=1, num_attention_heads=2,
                  intermediate_size=48, image_size=16, patch_size=4, max_num_tiles=MAX_TILES,
                  supported_aspect_ratios=ASPECT_RATIOS, intermediate_layers_indices=[0, 1],
                  vision_output_dim=32 * 3, norm_eps=1e-5)
    return MllamaConfig(text_config=text, vision_config=vision, image_token_index=image_id)


def init_tensor(name, shape, gen):
    leaf = name.split(".")[-1]
    if "gate" in leaf and "proj" not in name:  # cross_attn_*_gate, gate, gate_attn, gate_ffn
        return 0.3 + 0.7 * torch.rand(shape, generator=gen)
    if ("norm" in name or "layernorm" in name) and leaf == "weight":
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if leaf == "bias":
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    if leaf in ("class_embedding",) or "positional_embedding" in name:
        return 0.5 * torch.randn(shape, generator=gen)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=gen) / math.sqrt(fan_in)


def cmd_make_model(args):
    from transformers import MllamaForConditionalGeneration
    out = args.out_dir
    os.makedirs(out, exist_ok=True)
    tok = build_tokenizer()
    cfg = tiny_config(tok)
    torch.manual_seed(args.seed)
    model = MllamaForConditionalGeneration(cfg)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for k, p in sorted(model.state_dict().items()):
            p.copy_(init_tensor(k, tuple(p.shape), gen))
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    keys = set(load_file(os.path.join(out, "model.safetensors")).keys())
    released = [k for k in keys if k.startswith(("language_model.model.", "language_model.lm_head.", "vision_model.",
                                                 "multi_modal_projector."))]
    assert len(released) == len(keys), f"save_pretrained wrote in-memory names: {sorted(keys - set(released))[:4]}"
    assert "language_model.model.layers.1.cross_attn_attn_gate" in keys
    tok.save(os.path.join(out, "tokenizer.json"))
    print(f"wrote {out}: {len(keys)} tensors (released layout), tokenizer {tok.get_vocab_size()} ids, "
          f"<|image|> = {cfg.image_token_index}, text vocab_size {cfg.text_config.vocab_size}")


# ---------------------------------------------------------------------------------------------
def load_model(out_dir, attn="sdpa", dtype=torch.float64):
    from transformers import MllamaForConditionalGeneration
    m = MllamaForConditionalGeneration.from_pretrained(out_dir, torch_dtype=torch.float32, attn_implementation=attn)
    return m.to(dtype).eval()


def disk_names(model):
    """in-memory parameter name -> on-disk name (the inverse of _checkpoint_conversion_mapping)."""
    import re
    inv = {"^model.language_model": "language_model.model", "^model.vision_model": "vision_model",
           "^model.multi_modal_projector": "multi_modal_projector", "^lm_head": "language_model.lm_head"}
    out = {}
    for n, _ in model.named_parameters():
        d = n
        for pat, rep in inv.items():
            d, k = re.subn(pat, rep, d)
            if k:
                break
        out[n] = d
    return out


def cmd_make_batch(args):
    from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                              get_cross_attention_token_mask)
    with open(os.path.join(args.out_dir, "config.json")) as f:
        cfg = json.load(f)
    image_id, V = cfg["image_token_index"], cfg["text_config"]["vocab_size"]
    S = cfg["vision_config"]["image_size"]
    max_tiles = cfg["vision_config"].get("max_num_tiles", MAX_TILES)
    aspect_ratios = cfg["vision_config"].get("supported_aspect_ratios", ASPECT_RATIOS)
    L = args.length
    gen = torch.Generator().manual_seed(args.seed)
    ordinary = V - len(SPECIALS)  # ids below the added specials
    if args.one_image:  # one sample, one square image (release-sized models: the tower's cost)
        B, positions, ratios = 1, [[4]], [[(1, 1)]]
    else:  # a group of two consecutive images, then a third; a second sample with one
        B, positions, ratios = 2, [[4, 5, L // 2], [7]], [[(1, 2), (1, 1), (2, 1)], [(1, 1)]]
    ids = torch.randint(0, ordinary, (B, L), generator=gen)
    ids[:, 0] = V - len(SPECIALS)  # <|begin_of_text|>
    for b, ps in enumerate(positions):
        for p in ps:
            ids[b, p] = image_id
    n_img = max(len(r) for r in ratios)
    pv = torch.zeros(B, n_img, max_tiles, 3, S, S)
    ar_ids = torch.zeros(B, n_img, dtype=torch.int64)
    ar_mask = torch.zeros(B, n_img, max_tiles, dtype=torch.int64)
    ar_mask[:, :, 0] = 1  # build_aspect_ratio_mask: tile 0 of every image, padding included
    num_tiles = []
    for b, rs in enumerate(ratios):
        nt = []
        for j, (h, w) in enumerate(rs):
            t = h * w
            pv[b, j, :t] = torch.rand(t, 3, S, S, generator=gen) * 2 - 1
            ar_ids[b, j] = [list(r) for r in aspect_ratios].index([h, w]) + 1
            ar_mask[b, j, :t] = 1
            nt.append(t)
        num_tiles.append(nt)
    token_masks = [get_cross_attention_token_mask(ids[b].tolist(), image_id) for b in range(B)]
    cam = torch.from_numpy(convert_sparse_cross_attention_mask_to_dense(token_masks, num_tiles, max_tiles, L))
    assert cam.shape == (B, L, n_img, max_tiles), cam.shape
    labels = torch.randint(0, ordinary, (B, L), generator=gen)
    labels[ids == image_id] = -100
    labels[:, 0] = -100
    labels[torch.rand(B, L, generator=gen) < 0.25] = -100
    save_file({"input_ids": ids.contiguous(), "pixel_values": pv.contiguous(), "aspect_ratio_ids": ar_ids,
               "aspect_ratio_mask": ar_mask.contiguous(), "cross_attention_mask": cam.contiguous(),
               "labels": labels.contiguous()}, args.batch_file)
    print(f"wrote {args.batch_file}: B={B} L={L}, images {[len(r) for r in ratios]} (padded to {n_img}), "
          f"<|image|> at {positions}")


def model_inputs(batch, dtype=torch.float64):
    return dict(input_ids=batch["input_ids"].long(), pixel_values=batch["pixel_values"].to(dtype),
                aspect_ratio_ids=batch["aspect_ratio_ids"].long(), aspect_ratio_mask=batch["aspect_ratio_mask"].long(),
                cross_attention_mask=batch["cross_attention_mask"].long())


def loss_fn(logits, labels):
    keep = labels != -100
    return F.cross_entropy(logits[keep], labels[keep])


def vision_outputs(model, batch):
    inp = model_inputs(batch)
    B, N = inp["pixel_values"].shape[:2]
    vo = model.model.vision_model(pixel_values=inp["pixel_values"], aspect_ratio_ids=inp["aspect_ratio_ids"],
                                  aspect_ratio_mask=inp["aspect_ratio_mask"]).last_hidden_state
    cs = model.model.multi_modal_projector(vo)  # [B, N, tiles, tokens, hidden]
    return vo.reshape(B * N, -1, vo.shape[-1]), cs.reshape(B * N, -1, cs.shape[-1])


def cmd_run(args):
    model = load_model(args.out_dir, dtype=torch.float32 if args.float32 else torch.float64)
    batch = load_file(args.batch_file)
    out = {}
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(args.backward):
        res = model(**model_inputs(batch, model.dtype), output_hidden_states=args.intermediates, use_cache=False)
        logits = res.logits
        out["logits"] = logits.detach().float().contiguous()
        if args.backward:
            loss = loss_fn(logits, batch["labels"].long())
            loss.backward()
            out["loss"] = loss.detach().float()
            names = disk_names(model)
            on_disk = set(load_file(os.path.join(args.out_dir, "model.safetensors")).keys())
            for n, p in model.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                out["grad." + names[n]] = g.float().contiguous()
            got = set(k[5:] for k in out if k.startswith("grad."))
            assert got == on_disk, (sorted(got ^ on_disk)[:6])
    if args.intermediates:
        with torch.no_grad():
            vo, cs = vision_outputs(model, batch)
        out["vision_output"] = vo.float().contiguous()
        out["cross_attention_states"] = cs.float().contiguous()
        for i, h in enumerate(res.hidden_states[1:]):
            out[f"hidden.{i}"] = h.detach().float().contiguous()
        out["rope_inv_freq"] = model.model.language_model.rotary_emb.inv_freq.float().contiguous()
    save_file(out, args.expected_file)
    msg = f"wrote {args.expected_file}: logits {tuple(out['logits'].shape)}"
    if args.backward:
        msg += f", loss {out['loss'].item():.6f}, {sum(k.startswith('grad.') for k in out)} gradients"
    print(msg)


def greedy(model, batch, n):
    inp = model_inputs(batch)
    ids, cam = inp.pop("input_ids"), inp.pop("cross_attention_mask")
    tokens, steps = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=ids, cross_attention_mask=cam, use_cache=False, **inp).logits[:, -1]
            nxt = logits.argmax(-1)  # first maximum: lowest id on ties
            tokens.append(nxt)
            steps.append(logits.float())
            ids = torch.cat([ids, nxt[:, None]], 1)
            cam = torch.cat([cam, cam[:, -1:]], 1)
    return torch.stack(tokens, 1), torch.stack(steps, 1)


def cmd_generate(args):
    model = load_model(args.out_dir)
    tokens, steps = greedy(model, load_file(args.batch_file), args.tokens)
    save_file({"tokens": tokens.contiguous(), "step_logits": steps.contiguous()}, args.expected_file)
    print(f"wrote {args.expected_file}: tokens {tokens.tolist()}")


# ---------------------------------------------------------------------------------------------
def cmd_selfcheck(args):
    failures = []

    def ck(ok, msg):
        print(("ok   " if ok else "FAIL ") + msg)
        if not ok:
            failures.append(msg)

    work = args.workdir or tempfile.mkdtemp(prefix="mllama_ref_")
    os.makedirs(work, exist_ok=True)
    mdir, bfile = os.path.join(work, "model"), os.path.join(work, "batch.safetensors")
    me = sys.argv[0]
    ns = argparse.Namespace
    cmd_make_model(ns(out_dir=mdir, seed=0, dtype="fp32"))
    cmd_make_batch(ns(out_dir=mdir, batch_file=bfile, seed=0, length=24))
    batch = load_file(bfile)
    model = load_model(mdir)
    eager = load_model(mdir, attn="eager")
    inp = model_inputs(batch)
    with torch.no_grad():
        base = model(**inp).logits
        e = (eager(**inp).logits - base).abs().max().item()
    ck(e < 1e-5, f"eager (fp32 softmax) == sdpa fp64: max logit diff {e:.2g}")
    ck(bool(torch.isfinite(base).all()), "logits finite")
    layers = model.model.language_model.layers
    for li in model.config.text_config.cross_attention_layers:
        for gate in ("cross_attn_attn_gate", "cross_attn_mlp_gate"):
            p = getattr(layers[li], gate)
            old = p.detach().clone()
            with torch.no_grad():
                p.zero_()
                d = (model(**inp).logits - base).abs().max().item()
                p.copy_(old)
            ck(d > 1e-3, f"layer {li} {gate} = 0 changes the logits by {d:.3g}")
    # HF's all-keys quirk: rows before the first <|image|> (all-zero mask rows) see every key, padding images and
    # tiles included; their change reaches every later row of the sample through self-attention, never the other
    # sample (images are encoded independently)
    cam = batch["cross_attention_mask"]
    for b, j, t, what in ((0, 2, 0, "sample 0's third image"), (1, 2, 1, "a padding tile of sample 1's padding image")):
        pv = batch["pixel_values"].clone()
        pv[b, j, t] += 0.3
        with torch.no_grad():
            out = model(**{**inp, "pixel_values": pv.double()}).logits
        ch = (out - base).abs().amax(-1) > 1e-9
        blind = ~cam[b].flatten(1).any(-1)
        first = int(blind.long().argmin())
        ck(bool(blind[:first].all()) and first > 0 and bool(ch[b, :first].all()) and not bool(ch[1 - b].any()),
           f"pixels of {what}: the {first} rows before the first <|image|> change (all-keys quirk), "
           f"sample {1 - b} does not")
    # without the quirk (rows with an all-zero mask row masked out of the cross-attention) those rows would not
    with torch.no_grad():
        no_img = model(**{**inp, "pixel_values": torch.zeros_like(inp["pixel_values"])}).logits
    d = (no_img - base)[0, :4].abs().max().item()
    ck(d > 1e-6, f"rows before the first image depend on the images (quirk): {d:.3g}")
    # the released key layout
    keys = set(load_file(os.path.join(mdir, "model.safetensors")).keys())
    ck(all(k.startswith(("language_model.", "vision_model.", "multi_modal_projector.")) for k in keys),
       f"model.safetensors holds the released layout ({len(keys)} keys)")
    # rope: llama3 scaling applied
    inv = model.model.language_model.rotary_emb.inv_freq.float()  # .double() widened the fp32 buffer
    D = 16
    plain = 1.0 / (5e5 ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    ck(bool(inv[0] == plain[0]) and torch.allclose(inv[2:], plain[2:] / 8) and bool(inv[1] < plain[1]) and
       bool(inv[1] > plain[1] / 8), "rope inv_freq: llama3 scaling (kept, smoothed, /8)")
    if not args.workdir:
        shutil.rmtree(work)
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-model")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p = sub.add_parser("make-batch")
    p.add_argument("out_dir")
    p.add_argument("batch_file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--one-image", action="store_true", help="one sample with one square image")
    p = sub.add_parser("run")
    p.add_argument("out_dir")
    p.add_argument("batch_file")
    p.add_argument("expected_file")
    p.add_argument("--backward", action="store_true")
    p.add_argument("--intermediates", action="store_true")
    p.add_argument("--float32", action="store_true", help="run the model in float32 (default float64)")
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
