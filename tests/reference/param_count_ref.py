"""Parameter counts of a model's config.json from the reference packages, built on the meta device
(no memory, no weights): the independent side of lvx's sizing from config.json alone.

  param_count_ref.py count CONFIG.json...   prints {"total": N, "vision": V, "unused": U} as JSON,
                                            one line per config in order (one process: the
                                            packages are imported once)
  param_count_ref.py names CONFIG.json...   prints {"tensors": {name: shape}} as JSON, one line
                                            per config: every tensor a release's files hold, by
                                            its on-disk name (what lvx init-model must write)

  mllama      transformers' MllamaForConditionalGeneration(MllamaConfig(**config)); vision = the
              vision_model's parameters (the tower lvx freezes by default; the projector trains).
  mplugowl3   transformers' Qwen2ForCausalLM and SiglipVisionModel (the modules the release's
              remote code instantiates) plus the release's own tensors: the projector
              vision2text_model (two linears) and each hyper layer's v_kv_proj and gate
              (mplug_owl3_ref.state_dict_template, the same construction the tests' models use).
              unused: what the release never runs, so a runtime need not hold it: mPLUG-Owl3
              takes the SigLIP tower's next-to-last hidden states, so its last encoder layer and
              its final LayerNorm and attention-pooling head (vision_model.post_layernorm, .head) are
              never computed.

  openflamingo open_flamingo's Flamingo (open_clip ViT, the LM of text_config, perceiver, gated
              cross-attention blocks) from lvx's converted config.json (count_openflamingo).

  llama32-config OUT.json   writes Llama-3.2-11B-Vision's config.json as transformers lays it out
              (MllamaConfig's defaults are that model; the release's rope_scaling, context and
              560-pixel tiles set as its config.json has them).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def shapes_mllama(cfg):
    """On-disk names (save_pretrained reverses _checkpoint_conversion_mapping) and shapes."""
    import re
    from transformers import MllamaConfig, MllamaForConditionalGeneration
    c = MllamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        m = MllamaForConditionalGeneration(c)
    inv = {"^model.language_model": "language_model.model", "^model.vision_model": "vision_model",
           "^model.multi_modal_projector": "multi_modal_projector",
           "^lm_head": "language_model.lm_head"}
    out = {}
    for n, p in m.named_parameters():  # tied weights once, as save_pretrained writes them
        for pat, rep in inv.items():
            n = re.sub(pat, rep, n)
        out[n] = tuple(p.shape)
    return out


def count_mllama(cfg):
    shapes = shapes_mllama(cfg)
    numel = {k: int(torch.Size(v).numel()) for k, v in shapes.items()}
    total = sum(numel.values())
    vision = sum(n for k, n in numel.items() if k.startswith("vision_model."))
    return total, vision, 0


def shapes_mplugowl3(cfg):
    import mplug_owl3_ref as owl
    with torch.device("meta"):
        shapes = owl.state_dict_template(cfg, "240728")
    if cfg.get("tie_word_embeddings"):
        shapes.pop("language_model.lm_head.weight", None)
    return shapes


def count_mplugowl3(cfg):
    numel = {k: int(torch.Size(v).numel()) for k, v in shapes_mplugowl3(cfg).items()}
    total = sum(numel.values())
    vision = sum(n for k, n in numel.items() if k.startswith("vision_model."))
    last = cfg["vision_config"]["num_hidden_layers"] - 1
    unused = sum(n for k, n in numel.items()
                 if k.startswith((f"vision_model.encoder.layers.{last}.", "vision_model.head.",
                                  "vision_model.post_layernorm.")))
    return total, vision, unused


def shapes_openflamingo(cfg):
    """open_flamingo's Flamingo as its factory builds it (create_model_and_transforms): the
    open_clip ViT's visual tower, the LM from text_config (resized to vocab_size, as the factory
    resizes it to the tokenizer), PerceiverResampler and a GatedCrossAttentionBlock before every
    cross_attn_every_n_layers-th decoder layer; built from lvx's converted config.json (the layout
    openflamingo_ref.py's converter writes), on meta. unused: the ViT's output projection
    (visual.proj), which only the pooled embedding passes: Flamingo takes the patch tokens."""
    import logging
    import tempfile
    import open_clip
    from open_flamingo import Flamingo
    from open_flamingo.src.flamingo_lm import FlamingoLMMixin
    from open_flamingo.src.helpers import GatedCrossAttentionBlock, PerceiverResampler
    from open_flamingo.src.utils import extend_instance
    from transformers import AutoConfig, AutoModelForCausalLM
    vc, pc, xc = cfg["vision_config"], cfg["perceiver_config"], cfg["cross_attn_config"]
    vision_cfg = {"image_size": vc["image_size"], "layers": vc["layers"], "width": vc["width"],
                  "patch_size": vc["patch_size"], "head_width": vc["head_width"],
                  "mlp_ratio": vc["mlp_ratio"], "no_ln_pre": not vc["ln_pre"]}
    name = f"lvxcount-vit-{os.getpid()}"
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, name + ".json"), "w") as f:
            json.dump({"embed_dim": vc["output_dim"], "quick_gelu": vc["act"] == "quick_gelu",
                       "vision_cfg": vision_cfg,
                       "text_cfg": {"context_length": 4, "vocab_size": 8, "width": 8, "heads": 1,
                                    "layers": 1}}, f)
        open_clip.add_model_config(os.path.join(d, name + ".json"))
    logging.getLogger().setLevel(logging.ERROR)
    tc = dict(cfg["text_config"])
    tc["vocab_size"] = cfg["vocab_size"]
    with torch.device("meta"):
        clip = open_clip.create_model(name, device="meta")
        clip.visual.output_tokens = True
        lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(tc.pop("model_type"), **tc))
        extend_instance(lm, FlamingoLMMixin)
        lm.set_decoder_layers_attr_name(cfg["decoder_layers_attr"])
        model = Flamingo(clip, lm, cfg["endofchunk_token_id"], cfg["media_token_id"],
                         vis_dim=vc["width"],
                         cross_attn_every_n_layers=cfg["cross_attn_every_n_layers"])
        # The factory's defaults, unless the config says otherwise (the tests' tiny models).
        model.perceiver = PerceiverResampler(dim=pc["dim"], depth=pc["depth"],
                                             dim_head=pc["dim_head"], heads=pc["heads"],
                                             num_latents=pc["num_latents"], ff_mult=pc["ff_mult"],
                                             max_num_media=pc["max_num_media"],
                                             max_num_frames=pc["max_num_frames"])
        lm.gated_cross_attn_layers = torch.nn.ModuleList([
            GatedCrossAttentionBlock(dim=xc["dim"], dim_visual=xc["dim_visual"],
                                     dim_head=xc["dim_head"], heads=xc["heads"],
                                     ff_mult=xc["ff_mult"],
                                     only_attend_immediate_media=xc["only_attend_immediate_media"])
            if i in cfg["cross_attn_layers"] else None for i in range(cfg["num_decoder_layers"])])
        lm.init_flamingo_layers(False)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied embeddings once


def count_openflamingo(cfg):
    numel = {k: int(torch.Size(v).numel()) for k, v in shapes_openflamingo(cfg).items()}
    total = sum(numel.values())
    vision = sum(n for k, n in numel.items() if k.startswith("vision_encoder."))
    unused = sum(n for k, n in numel.items() if k == "vision_encoder.proj")
    return total, vision, unused


def cmd_count(args):
    for path in args.config:
        with open(path) as f:
            cfg = json.load(f)
        kind = cfg.get("model_type")
        counter = {"mllama": count_mllama, "mplugowl3": count_mplugowl3,
                   "openflamingo": count_openflamingo}.get(kind)
        if counter is None:
            sys.exit(f"{path}: model_type {kind!r} has no reference count here")
        total, vision, unused = counter(cfg)
        print(json.dumps({"total": total, "vision": vision, "unused": unused}), flush=True)


def cmd_names(args):
    for path in args.config:
        with open(path) as f:
            cfg = json.load(f)
        kind = cfg.get("model_type")
        shapes = {"mllama": shapes_mllama, "mplugowl3": shapes_mplugowl3,
                  "openflamingo": shapes_openflamingo}.get(kind)
        if shapes is None:
            sys.exit(f"{path}: model_type {kind!r} has no reference layout here")
        print(json.dumps({"tensors": {k: list(v) for k, v in sorted(shapes(cfg).items())}}),
              flush=True)


def cmd_llama32_config(args):
    from transformers import MllamaConfig
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    c = MllamaConfig(text_config={"rope_scaling": rope, "max_position_embeddings": 131072,
                                  "rope_theta": 500000.0},
                     vision_config={"image_size": 560})
    d = c.to_dict()
    d["torch_dtype"] = "bfloat16"
    d["architectures"] = ["MllamaForConditionalGeneration"]
    with open(args.out, "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("count")
    p.add_argument("config", nargs="+")
    p = sub.add_parser("names")
    p.add_argument("config", nargs="+")
    p = sub.add_parser("llama32-config")
    p.add_argument("out")
    args = ap.parse_args()
    {"count": cmd_count, "names": cmd_names, "llama32-config": cmd_llama32_config}[args.cmd](args)


if __name__ == "__main__":
    main()
