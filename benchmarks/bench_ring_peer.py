"""lvx's distributed strategies against ring-attention-pytorch (0.5.20, pure torch: einsum GEMMs
over key buckets, K/V rotating), side by side in one run, on the same shards and the same ranks.

    build/lvx launch --nproc 2 -- python benchmarks/bench_ring_peer.py [--shapes 4096x4096,...]
        [--heads 8] [--dim 64] [--reps 3] [--bucket 1024]
    (add --nodes 2 --emulate configs/clusters/a100_80g_16.yaml to lvx launch for slow links)

Each shape is SqxSkv; `c` after it (4096x4096c) makes it causal self-attention. Every rank holds
1/n of the queries and of the keys (contiguous shards). Correctness first: every method's output
on this rank against exact attention (fp32, torch's SDPA on the whole tensors); a method that is
not exact there is reported as such and not timed. ring-attention-pytorch is exact on
self-attention (Sq = Skv); with Sq != Skv it turns its ring off (ring_flash_attn:
`ring_reduce_col &= not cross_attn`) and each rank attends to its own keys only, so cross-
attention shapes show it as inexact. Then the fastest of --reps forward+backward calls per method
(all ranks synchronised before each; each call's time is its slowest rank's), and each lvx
strategy's ratio to the peer (> 1: lvx faster). Numbers vary between runs on a shared machine:
compare ratios within one run.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lvx
from ring_attention_pytorch.ring_flash_attention import ring_flash_attn


def slowest(seconds):
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn, reps):
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, slowest(time.perf_counter() - t0))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2048x2048,4096x4096,4096x4096c,512x32768")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket", type=int, default=1024, help="the peer's bucket size")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    n, r = dist.get_world_size(), dist.get_rank()
    H, D = a.heads, a.dim
    if r == 0:
        print(f"| Sq | Skv | mask | method | exact (max err) | fwd+bwd s | lvx / peer |")
        print("|---|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        causal = shape.endswith("c")
        sq, skv = (int(x) for x in shape.rstrip("c").split("x"))
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, sq, H, D, generator=g)
        k = torch.randn(1, skv, H, D, generator=g)
        v = torch.randn(1, skv, H, D, generator=g)
        do = torch.randn(1, sq, H, D, generator=g)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        mine = lambda t: t.chunk(n, 1)[r].contiguous()
        qs, ks, vs, dos, refs = mine(q), mine(k), mine(v), mine(do), mine(ref)

        def peer():
            qq, kk, vv = (x.clone().requires_grad_() for x in (qs, ks, vs))
            o = ring_flash_attn(qq, kk, vv, None, causal, a.bucket, True, False, None, n)
            o.backward(dos)
            return o

        def ours(strategy):
            def run():
                qq, kk, vv = (x.clone().requires_grad_() for x in (qs, ks, vs))
                o = lvx.attention(qq, kk, vv, strategy=strategy,
                                  mask="causal" if causal else "none")
                o.backward(dos)
                return o
            return run

        methods = [("ring-attention-pytorch", peer)]
        for s in ["ring", "lv_xattn", "striped"] if causal or sq == skv else ["lv_xattn", "ring"]:
            if s == "striped":  # striped holds other tokens: its own layout, not comparable here
                continue
            methods.append((f"lvx {s}", ours(s)))
        peer_time = None
        for name, fn in methods:
            err = torch.tensor([(fn().detach() - refs).abs().max().item()], dtype=torch.float64)
            dist.all_reduce(err, op=dist.ReduceOp.MAX)
            exact = err.item() <= 1e-4
            t = timed(fn, a.reps) if exact else float("nan")
            if name == "ring-attention-pytorch":
                peer_time = t if exact else None
            ratio = f"{peer_time / t:.2f}x" if peer_time and name != "ring-attention-pytorch" else "-"
            if r == 0:
                print(f"| {sq} | {skv} | {'causal' if causal else 'none'} | {name} | "
                      f"{'yes' if exact else 'NO'} ({err.item():.1e}) | "
                      f"{t:.3f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
