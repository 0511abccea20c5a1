"""PEFT reference for lvx's LoRA (models/lora.h): the `peft` package from PyPI (pinned, 0.17.1) on
transformers' Qwen2 language model of an mPLUG-Owl3 reference checkpoint (mplug_owl3_ref.py).

usage:
  lora_ref.py make-adapter [--family mplugowl3|openflamingo] MODEL_DIR ADAPTER_DIR [--r 4] [--alpha 8] [--targets q_proj,v_proj]
                           [--seed S] [--rslora]
  lora_ref.py logits [--family mplugowl3|openflamingo] MODEL_DIR BATCH.safetensors OUT.safetensors [--adapter DIR] [--backward]
  lora_ref.py merged-logits MERGED_DIR BATCH.safetensors OUT.safetensors

The PyTorch model is a module whose parameter names are the checkpoint's own: an nn.Module with one
attribute `language_model` = transformers.Qwen2ForCausalLM (so the module paths are
"language_model.model.layers.<i>.self_attn.q_proj", as in the released mPLUG-Owl3 model), loaded
from the checkpoint's language_model.* tensors (the hyper layers' v_kv_proj and gate are not part of
Qwen2: batches here have no images, and lvx's mPLUG-Owl3 with no image equals Qwen2, which
mplug_owl3_ref.py checks on every run). fp32, attention "eager".

make-adapter: peft.get_peft_model(model, LoraConfig(r, lora_alpha, target_modules, lora_dropout 0,
use_rslora)), then every lora_A and lora_B set to N(0, 0.1²) from --seed (PEFT initialises B to zero,
which would make the adapter a no-op), saved with PeftModel.save_pretrained (PEFT's own layout).

logits: input_ids of the batch (no images) through the model, with --adapter wrapped by
peft.PeftModel.from_pretrained(model, DIR); checks that PEFT injected a LoRA layer for every pair the
adapter file holds (a key PEFT cannot place would otherwise be dropped with a warning only). Writes
logits float32 [B, L, V]; with --backward (PEFT model) also loss (mean cross-entropy over labels !=
-100, position t's logits predict labels[t]) and grad.<module path>.lora_A.weight / lora_B.weight
(lvx's names for the adapter's tensors).

--family openflamingo (make-adapter, logits): the open_flamingo package's Flamingo rebuilt from an lvx
OpenFlamingo directory by openflamingo_ref.py (module paths = the directory's tensor names), fp32, run
on the batch WITH its images (openflamingo_ref.py make-batch). PEFT saves the gated cross-attention
blocks under both of their paths (an alias list on lang_encoder); the placement check counts every path.

merged-logits: a merged checkpoint (lvx merge-adapter) loaded by transformers alone, its logits.

random-adapter MODEL_DIR ADAPTER_DIR --under PREFIX[,PREFIX] [--r 2] [--seed S]: an adapter in
PEFT's file layout written without PEFT, on EVERY linear weight of the checkpoint under the
prefixes (2-D
"<module>.weight" tensors, embeddings and output heads left out), A and B both N(0, 0.1²): what
the activation-path test needs to see that no linear of a family bypasses the LoRA branch.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mplug_owl3_ref as owl  # noqa: E402  (checkpoint reading and the Qwen2 config)


class LanguageModelOnly(torch.nn.Module):
    """The mPLUG-Owl3 module tree's `language_model` branch, under the release's names."""

    def __init__(self, model_dir):
        super().__init__()
        from transformers import Qwen2ForCausalLM
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
        qcfg = owl.qwen2_config(cfg)
        qcfg._attn_implementation = "eager"
        self.language_model = Qwen2ForCausalLM(qcfg).float().eval()
        sd = owl.load_checkpoint(model_dir)
        lsd = {k[len("language_model."):]: v for k, v in sd.items()
               if k.startswith("language_model.") and not k.endswith(("v_kv_proj.weight", "v_kv_proj.bias", "self_attn.gate"))}
        self.language_model.load_state_dict(lsd, strict=True)

    def forward(self, input_ids):
        return self.language_model(input_ids=input_ids).logits


def flamingo(model_dir):
    """The open_flamingo package's Flamingo rebuilt from an lvx OpenFlamingo directory
    (openflamingo_ref.py build_from_converted), fp32; module paths = the directory's tensor names."""
    import openflamingo_ref as ofr
    model, _, _ = ofr.build_from_converted(model_dir)
    return model.float().eval()


def load_model(args):
    return flamingo(args.model_dir) if args.family == "openflamingo" else LanguageModelOnly(args.model_dir)


def run_model(args, model, batch):
    if args.family == "openflamingo":  # with the batch's images
        import openflamingo_ref as ofr
        return ofr.forward(model, batch, torch.float32)
    assert "pixel_values" not in batch or batch["pixel_values"].shape[0] == 0, "batches here have no images"
    return model(batch["input_ids"].long())


def cmd_make_adapter(args):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = load_model(args)
    cfg = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=args.targets.split(","),
                     use_rslora=args.rslora)
    pm = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(args.seed)
    n = 0
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
                n += 1
    pm.save_pretrained(args.adapter_dir)
    print(f"wrote {args.adapter_dir}: {n} LoRA tensors, r {args.r}, alpha {args.alpha}, targets {args.targets}")


def lvx_name(peft_name):
    """base_model.model.<path>.lora_A.default.weight -> <path>.lora_A.weight (lvx's parameter names)."""
    s = peft_name[len("base_model.model."):] if peft_name.startswith("base_model.model.") else peft_name
    return s.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def cmd_logits(args):
    torch.manual_seed(0)
    model = load_model(args)
    batch = load_file(args.batch_file)
    out = {}
    if args.adapter:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
        model = PeftModel.from_pretrained(model, args.adapter, is_trainable=args.backward)
        pairs = {k[:-len(".lora_A.weight")] for k in load_file(os.path.join(args.adapter, "adapter_model.safetensors"))
                 if k.endswith(".lora_A.weight")}
        # Every path (aliases of one module included) under which PEFT placed a LoRA layer.
        placed = {n for n, m in model.named_modules(remove_duplicate=False) if isinstance(m, LoraLayer)}
        missing = pairs - placed
        if missing:
            sys.exit(f"PEFT placed no LoRA layer for {len(missing)} of the file's {len(pairs)} pairs: {sorted(missing)[:5]}")
        injected = {id(m) for m in model.modules() if isinstance(m, LoraLayer)}
        print(f"PEFT placed every pair of the file ({len(pairs)} paths, {len(injected)} LoRA layers)")
    with torch.set_grad_enabled(args.backward):
        logits = run_model(args, model, batch)
        out["logits"] = logits.detach().float()
        if args.backward:
            labels = batch["labels"].long()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                                     ignore_index=-100)
            loss.backward()
            out["loss"] = loss.detach().float()
            for name, p in model.named_parameters():
                if p.requires_grad:
                    assert ".lora_" in name, name
                    out["grad." + lvx_name(name)] = p.grad.detach().float()
    save_file({k: v.contiguous() for k, v in out.items()}, args.out_file)
    print(f"wrote {args.out_file}: {len(out)} tensors")


def cmd_merged_logits(args):
    torch.manual_seed(0)
    model = LanguageModelOnly(args.model_dir)
    ids = load_file(args.batch_file)["input_ids"].long()
    with torch.no_grad():
        save_file({"logits": model(ids).float().contiguous()}, args.out_file)
    print(f"wrote {args.out_file}")


def cmd_random_adapter(args):
    names = []
    for f in sorted(os.listdir(args.model_dir)):
        if f.endswith(".safetensors"):
            names += [(k, v.shape) for k, v in load_file(os.path.join(args.model_dir, f)).items()]
    skip = ("embed_tokens", "embed_in", "wte", "wpe", "lm_head", "embed_out")
    gen = torch.Generator().manual_seed(args.seed)
    tensors, modules = {}, set()
    for name, shape in sorted(names):
        if not name.startswith(tuple(args.under.split(","))) or not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[:-len(".weight")]
        if module.rsplit(".", 1)[-1] in skip:
            continue
        modules.add(module.rsplit(".", 1)[-1])
        out, inp = shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = 0.1 * torch.randn(args.r, inp, generator=gen)
        tensors[f"base_model.model.{module}.lora_B.weight"] = 0.1 * torch.randn(out, args.r, generator=gen)
    assert tensors, f"no linear weight under {args.under}"
    os.makedirs(args.adapter_dir, exist_ok=True)
    save_file(tensors, os.path.join(args.adapter_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = {"peft_type": "LORA", "r": args.r, "lora_alpha": 2 * args.r, "lora_dropout": 0.0, "bias": "none",
           "target_modules": sorted(modules), "use_rslora": False, "fan_in_fan_out": False,
           "base_model_name_or_path": args.model_dir, "task_type": None}
    with open(os.path.join(args.adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"wrote {args.adapter_dir}: {len(tensors) // 2} LoRA pairs under {args.under}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("random-adapter")
    p.add_argument("model_dir")
    p.add_argument("adapter_dir")
    p.add_argument("--under", required=True)
    p.add_argument("--r", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("make-adapter")
    p.add_argument("model_dir")
    p.add_argument("adapter_dir")
    p.add_argument("--r", type=int, default=4)
    p.add_argument("--alpha", type=float, default=8)
    p.add_argument("--targets", default="q_proj,v_proj")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rslora", action="store_true")
    p.add_argument("--family", choices=["mplugowl3", "openflamingo"], default="mplugowl3")
    p = sub.add_parser("logits")
    p.add_argument("--family", choices=["mplugowl3", "openflamingo"], default="mplugowl3")
    p.add_argument("model_dir")
    p.add_argument("batch_file")
    p.add_argument("out_file")
    p.add_argument("--adapter", default="")
    p.add_argument("--backward", action="store_true")
    p = sub.add_parser("merged-logits")
    p.add_argument("model_dir")
    p.add_argument("batch_file")
    p.add_argument("out_file")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    {"make-adapter": cmd_make_adapter, "random-adapter": cmd_random_adapter, "logits": cmd_logits, "merged-logits": cmd_merged_logits}[args.cmd](args)


if __name__ == "__main__":
    main()
