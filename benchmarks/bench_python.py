"""`import lvx` against what a PyTorch user writes without it, side by side in one run.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/bench_python.py \
        [--text 1024] [--frames 64] [--tokens-per-frame 256] [--heads 8] [--kv-heads 8] \
        [--dim 64] [--reps 5] [--dtype fp32]

One cross-attention layer (text queries over the video's visual tokens, OpenFlamingo's media mask
with the frames spread over the text, or --mask none), each rank holding 1/n of the text and 1/n
of the frames, forward + backward:
  gather+sdpa  torch.distributed.nn.functional.all_gather of K and V (differentiable), then
               scaled_dot_product_attention with the media mask on this rank's queries
  lvx <s>      lvx.attention(strategy=s) for lv_xattn, ring and all_gather
Correctness first: every method's output and gradients against gather+sdpa (fp32: ≤ 1e-4
relative to the largest value). Then the fastest of --reps calls per method (all ranks
synchronised before each), its ratio to gather+sdpa, and the bytes each rank sent (lvx's
counters; for gather+sdpa the all-gather's and its reduce-scatter's volume, (n−1)·|K_r + V_r|
each way). Numbers vary between runs on a shared machine: compare ratios within one run.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn.functional as F

import lvx


def media_metadata(B, text, frames, tpf):
    """OpenFlamingo layout: frame f's <image> token sits at text position f·text/frames."""
    starts = torch.arange(frames) * (text // frames)
    ml = torch.zeros(B, text, dtype=torch.int32)
    ml[:, starts] = 1
    q_media = ml.cumsum(1, dtype=torch.int32) - 1        # latest frame before each token
    kv_media = torch.arange(frames, dtype=torch.int32).repeat_interleave(tpf).expand(B, -1)
    return q_media.contiguous(), kv_media.contiguous()


DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


def parse_args():
    """The command line (the usage above)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", type=int, default=1024)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--tokens-per-frame", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp64", "bf16"])
    ap.add_argument("--mask", default="media", choices=["media", "none"],
                    help="media: OpenFlamingo's media mask; none: every text token sees every frame")
    return ap.parse_args()


def random_inputs(a, dtype):
    """q, k, v and the loss weights w (loss = sum(o * w)), seeded: the same on every rank."""
    B, Sq, Skv, H, Hkv, D = 1, a.text, a.frames * a.tokens_per_frame, a.heads, a.kv_heads, a.dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Sq, H, D, generator=g).to(dtype)
    k = torch.randn(B, Skv, Hkv, D, generator=g).to(dtype)
    v = torch.randn(B, Skv, Hkv, D, generator=g).to(dtype)
    w = torch.randn(B, Sq, H, D, generator=g).to(dtype)
    return q, k, v, w


def make_methods(a, q_media, qm_l, kv_media):
    """(name, fn(q, k, v) -> o): gather+sdpa first (the baseline), then lvx's strategies."""
    Skv, unit = a.frames * a.tokens_per_frame, a.tokens_per_frame

    def gather_sdpa(q_, k_, v_):
        # What users write without lvx: gather the whole K/V on every rank, attend locally.
        kf = torch.cat(dnn.all_gather(k_.contiguous()), 1)
        vf = torch.cat(dnn.all_gather(v_.contiguous()), 1)
        allowed = (qm_l[:, :, None] == kv_media[:, None, :])[:, None] if a.mask == "media" else None
        o = F.scaled_dot_product_attention(q_.transpose(1, 2), kf.transpose(1, 2),
                                           vf.transpose(1, 2), attn_mask=allowed,
                                           enable_gqa=True)
        return o.transpose(1, 2)

    def lvx_call(strategy):
        media = a.mask == "media"
        return lambda q_, k_, v_: lvx.attention(
            q_, k_, v_, strategy=strategy, mask="media_immediate" if media else None,
            q_media=q_media if media else None, kv_media=kv_media if media else None,
            kv_len=Skv, kv_unit=unit)

    return [("gather+sdpa", gather_sdpa)] + [
        (f"lvx {s}", lvx_call(s)) for s in ("lv_xattn", "ring", "all_gather")]


def step(fn, shards):
    """One forward + backward of `fn` on fresh leaves of this rank's (q, k, v, w) shards: the
    output and the gradients of q, k and v."""
    ql, kl, vl, wl = shards
    q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (ql, kl, vl))
    o = fn(q_, k_, v_)
    (o * wl).sum().backward()
    return o.detach(), q_.grad, k_.grad, v_.grad


def check_methods(methods, shards, dtype, r):
    """Correctness first: every lvx method's output and gradients against gather+sdpa's; exits
    naming the first that differs."""
    base = step(methods[0][1], shards)
    for name, fn in methods[1:]:
        got = step(fn, shards)
        for label, x, y in zip(("o", "dq", "dk", "dv"), got, base):
            err = ((x.double() - y.double()).abs().max() / y.double().abs().max()).item()
            tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
            if err > tol:
                raise SystemExit(f"rank {r}: {name} {label} differs from gather+sdpa by {err:.2e} "
                                 f"(relative; tolerance {tol})")


def time_methods(methods, shards, reps, n):
    """Timing: the fastest of the reps, ranks synchronised before each call. (name, seconds,
    bytes each rank sent per call), each the slowest rank's."""
    kl, vl = shards[1], shards[2]
    results = []
    for name, fn in methods:
        best = float("inf")
        lvx.reset_counters()
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            step(fn, shards)
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)     # the slowest rank's time
            best = min(best, t.item())
        if name == "gather+sdpa":
            kv_bytes = (kl.numel() + vl.numel()) * kl.element_size()
            sent = 2 * (n - 1) * kv_bytes                   # all-gather fwd, reduce-scatter bwd
        else:
            sent = sum(lvx.counters()["sent"]) // reps
        t = torch.tensor([float(sent)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results.append((name, best, int(t.item())))
    return results


def print_results(a, n, results):
    """The settings line and one row per method, times against gather+sdpa's (rank 0)."""
    Sq, Skv, H, Hkv, D = a.text, a.frames * a.tokens_per_frame, a.heads, a.kv_heads, a.dim
    print(f"cross-attention fwd+bwd, {n} ranks, text {Sq} x visual {Skv} "
          f"({a.frames} frames x {a.tokens_per_frame}), H={H}/{Hkv} D={D} {a.dtype}, "
          f"mask {a.mask}, "
          f"fastest of {a.reps}; outputs and gradients checked against gather+sdpa")
    print(f"{'method':<16}{'time':>10}{'vs gather+sdpa':>17}{'MB sent/rank':>15}")
    t_base = results[0][1]
    for name, t, sent in results:
        print(f"{name:<16}{t * 1e3:>8.1f}ms{t_base / t:>16.2f}x{sent / 1e6:>15.2f}")


def main():
    a = parse_args()
    dist.init_process_group("gloo")
    n, r = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[a.dtype]
    q, k, v, w = random_inputs(a, dtype)
    q_media, kv_media = media_metadata(1, a.text, a.frames, a.tokens_per_frame)
    unit = a.tokens_per_frame
    ql, wl = lvx.shard(q), lvx.shard(w)
    kl, vl = lvx.shard(k, role="kv", unit=unit), lvx.shard(v, role="kv", unit=unit)
    qm_l = lvx.shard(q_media)
    shards = (ql, kl, vl, wl)
    methods = make_methods(a, q_media, qm_l, kv_media)
    check_methods(methods, shards, dtype, r)
    results = time_methods(methods, shards, a.reps, n)
    if r == 0:
        print_results(a, n, results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
