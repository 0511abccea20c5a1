"""Independent reference for `lvx attention`: PyTorch's scaled_dot_product_attention in float64
(with autograd for dq/dk/dv) on the same input file; prints one JSON line of max abs errors and
of the same-dtype reference's own error (for the dual-reference gate).

usage: sdpa_check.py INPUT OUTPUT MASK [--backward]
"""
import json
import sys

import torch
from safetensors.torch import load_file


def visibility(mask, t, sq, skv):
    if mask == "none":
        return None
    if mask == "causal":
        return torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)
    qm = t["q_media"].long().unsqueeze(2)
    km = t["kv_media"].long().unsqueeze(1)
    seen = (km == qm) if mask == "media_immediate" else (km <= qm)
    return (seen & (qm >= 0) & (km >= 0)).unsqueeze(1)  # [B, 1, Sq, Skv]


def sdpa(q, k, v, vis):
    # Rows that see nothing: SDPA gives NaN; lvx defines them as 0 (and lse = -inf).
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=vis, enable_gqa=True)
    return torch.nan_to_num(o.transpose(1, 2), nan=0.0)


def main():
    inp, out, mask = sys.argv[1:4]
    backward = "--backward" in sys.argv
    t, o = load_file(inp), load_file(out)
    sq, skv = t["q"].shape[1], t["k"].shape[1]
    vis = visibility(mask, t, sq, skv)
    result = {}
    for name, dt in (("fp64", torch.float64), ("same", t["q"].dtype)):
        q, k, v = (t[x].to(dt).requires_grad_() for x in ("q", "k", "v"))
        ref = sdpa(q, k, v, vis)
        if name == "fp64":
            ref64 = ref
            if backward:
                ref.backward(t["do"].double())
                grads64 = {"dq": q.grad, "dk": k.grad, "dv": v.grad}
            result["o"] = (o["o"].double() - ref64).abs().max().item()
            if backward:
                for g in ("dq", "dk", "dv"):
                    result[g] = (o[g].double() - grads64[g]).abs().max().item()
        else:
            result["o_same"] = (ref.double() - ref64).abs().max().item()
            if backward:
                ref.backward(t["do"].to(dt))
                for g, x in (("dq", q), ("dk", k), ("dv", v)):
                    result[g + "_same"] = (x.grad.double() - grads64[g]).abs().max().item()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
