"""Independent reference for lvx's fine-tuning optimizer: torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_ on the same gradients, with the learning rate of each step set
from the schedule written out here (linear warm-up, then cosine decay to min_lr).

usage: adamw_ref.py in.safetensors out.safetensors
  in:  param.<name> (initial values), grad.<step>.<name>; metadata "config" (JSON: lr, betas,
       eps, weight_decay, grad_clip, steps, warmup_steps, min_lr)
  out: param.<name> after every step, norm.<step> (the pre-clip global norm), lr.<step>
"""
import json
import math
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def lr_at(c, step):
    if c["warmup_steps"] > 0 and step < c["warmup_steps"]:
        return c["lr"] * (step + 1) / c["warmup_steps"]
    t = min(1.0, (step - c["warmup_steps"]) / max(1, c["steps"] - c["warmup_steps"]))
    return c["min_lr"] + (c["lr"] - c["min_lr"]) * 0.5 * (1 + math.cos(math.pi * t))


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with safe_open(src, "pt") as f:
        c = json.loads(f.metadata()["config"])
        t = {k: f.get_tensor(k) for k in f.keys()}
    names = sorted(k[len("param."):] for k in t if k.startswith("param."))
    params = [torch.nn.Parameter(t["param." + n].clone()) for n in names]
    opt = torch.optim.AdamW(params, lr=c["lr"], betas=tuple(c["betas"]), eps=c["eps"],
                            weight_decay=c["weight_decay"])
    out = {}
    for s in range(c["steps"]):
        for p, n in zip(params, names):
            p.grad = t[f"grad.{s}.{n}"].clone()
        norm = torch.nn.utils.clip_grad_norm_(params, c["grad_clip"])
        lr = lr_at(c, s)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        out[f"norm.{s}"] = norm.reshape(1).double()
        out[f"lr.{s}"] = torch.tensor([lr], dtype=torch.float64)
    for p, n in zip(params, names):
        out["param." + n] = p.detach().clone()
    save_file(out, dst)


if __name__ == "__main__":
    main()
