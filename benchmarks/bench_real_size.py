"""lvx at the sizes users run: release-shaped random checkpoints (lvx init-model) through lvx qa,
and lvx forward side by side with the library a user would otherwise run, each figure against
this machine's own limits measured in the same run.

  python benchmarks/bench_real_size.py [--parts qa,ranks,tiles,serve,finetune,peers] [--qa 1b:bf16,1b:fp32,2b:bf16,7b:bf16]
        [--peers mllama:fp32,mllama:bf16,openflamingo:fp32,openflamingo:bf16] [--repeats 2]
        [--frames 8] [--tokens 32] [--ckpt-dir ~/.cache/lvx/real-size] [--json out.json]

Limits (this machine, every thread lvx uses), measured at the start of the run: the matrix-product
rate of a 4096³ GEMM in fp32 and bf16 (torch), and the read bandwidth: the fastest way
benchmarks/bench_bandwidth finds to stream 2 GiB (a reduction, ATen's matrix-vector product, lvx's
streamed product over 4096 × 14336 and Qwen2-7B's MLP shapes; on this shared machine the ways
differ by up to 1.6×, and the fastest is the memory's rate).

qa: `lvx qa --json --ignore-stop` on a 60 s 640×360 video, --frames frames, --tokens tokens. The
time to first token is split into video decode, vision encode and the rest of the prefill.
  encode ratio  = the vision tower's FLOPs (2·parameters·tokens + 4·tokens²·width a layer, for
                  the layers run, and the projector) ÷ encode seconds ÷ the GEMM rate in the dtype
  prefill ratio = (vision + language model FLOPs) ÷ prefill seconds ÷ the GEMM rate
  decode ratio  = seconds per token ÷ (bytes read per token ÷ bandwidth): the decoder's weights
                  (the tied or separate head included, the vision tower and v_kv_proj not: visual
                  K/V are cached) and the cached visual and text K/V
  memory        = peak RSS (GNU time) against the weights in the run's dtype
ranks: `lvx qa` on the 1B in bf16 (--ranks-frames frames, --tokens tokens) at 1 rank, and at 2 with
rank 0 decoding alone (--decode-ranks one, the default: messages at the 4 cross layers only) and
with every rank decoding (all: a pass-Q message at each of the 24 layers), the three alternating
--repeats times; the answers must be equal; decode ms/token as median (range) and ÷ 1 rank's.
tiles: `lvx forward --generate` at Llama-3.2-11B-Vision's widths (whole ViT-H, 4 decoder layers,
vocabulary 32,000; bf16 where the CPU multiplies it natively, else fp32) on one 2 × 2-tile image
at 1 and 2 ranks, alternating --repeats times: from 2 ranks the image's tiles are encoded across
the ranks; prefill s median (range) and ÷ 1 rank's.
serve: benchmarks/bench_serve.py's load on the 1B in fp32 at 1 rank (answers must be equal on both
servers, which bf16's rounding of batched rows would not keep on random weights): 1, 4 and 16 clients, each
request a distinct question about one of 4 cached 6 s videos (3 frames), 16 tokens; the batched
server (continuous batching, --max-batch 16) against --max-batch 1, answers checked equal.
finetune: build/benchmarks/bench_finetune --memory on the 1B (fp32 training from its bf16 files,
2 frames a sample, 3 steps): LoRA r16 and full fine-tuning with ZeRO stage 3 (parallel.shard
parameters) at 2 ranks, samples/s and each rank's peak RSS beside lvx plan's prediction.
peers: `lvx forward --generate 16` against transformers' MllamaForConditionalGeneration at
Llama-3.2-11B-Vision's widths with 8 decoder layers (cross layers 3 and 7: 42 GB of fp32 weights
would not fit this machine; the ViT-H is whole) on one 4-tile image and 128 tokens, and against
open_flamingo's Flamingo at OpenFlamingo-3B's release shapes (all 24 layers) on 4 images and 128
tokens; the same checkpoint files and batch. Greedy tokens must be equal in fp32 (checked first).
The runs alternate (lvx, peer, lvx, peer, ...): each figure is the median of --repeats with its
range.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent
RELEASES = SOURCE / "configs" / "models" / "releases"
QA_MODELS = {"1b": "mplug_owl3_1b", "2b": "mplug_owl3_2b", "7b": "mplug_owl3_7b"}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def lvx_bin():
    return os.environ.get("LVX_BIN", str(SOURCE / "build" / "lvx"))


def timed(cmd, env=None):
    """Runs cmd under GNU time: (stdout, peak RSS bytes, wall seconds). Fails loudly."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        t0 = time.time()
        p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", tf.name] + cmd, capture_output=True,
                           text=True, env=env)
        wall = time.time() - t0
        if p.returncode != 0:
            raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
        rss = int(tf.read().strip().splitlines()[-1]) * 1024
    return p.stdout, rss, wall


# ---- this machine's limits ------------------------------------------------------------------------
def machine_limits(threads):
    import torch
    torch.set_num_threads(threads)

    def best(f, n=3):
        f()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return min(ts)

    out = {"threads": threads}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(4096, 4096, dtype=dt), torch.randn(4096, 4096, dtype=dt)
        out[f"gemm_{name}_flops"] = 2 * 4096 ** 3 / best(lambda: a @ b)
    # Read bandwidth: benchmarks/bench_bandwidth (a reduction, ATen's matrix-vector product and
    # lvx's streamed product over 2 GiB of several shapes; their fastest).
    bw = json.loads(subprocess.run([str(Path(lvx_bin()).parent / "benchmarks" / "bench_bandwidth"),
                                    "--threads", str(threads)], check=True, capture_output=True,
                                   text=True).stdout)
    out["bandwidth_ways"] = bw
    out["bandwidth"] = bw["fastest"]
    return out


# ---- checkpoints -------------------------------------------------------------------------------
def checkpoint(ckpt_dir, release, dtype, extra=(), tag=""):
    """The release-shaped checkpoint (made once by lvx init-model)."""
    out = Path(ckpt_dir) / f"{release}{tag}-{dtype}"
    if not (out / "config.json").exists():
        log(f"[init] {out}")
        subprocess.run([lvx_bin(), "init-model", "--config", str(RELEASES / release), "--out",
                        str(out), "--dtype", dtype, "--quiet", *extra], check=True)
    return out


def config_of(model):
    return json.loads((Path(model) / "config.json").read_text())


# ---- FLOPs and bytes of mPLUG-Owl3 (the formulas of the docstring) -------------------------------
def owl3_counts(cfg, frames, prompt_tokens, dtype_bytes):
    v = cfg["vision_config"]
    hv, mv, lv = v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"] - 1  # runs L-1
    T = (v["image_size"] // v["patch_size"]) ** 2
    H = cfg["hidden_size"]
    per_frame = (2 * T * hv * 3 * v["patch_size"] ** 2 + lv * (2 * T * (4 * hv * hv + 2 * hv * mv)
                 + 4 * T * T * hv) + 2 * T * (hv * H + H * H))
    heads, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = H // heads
    I, L = cfg["intermediate_size"], cfg["num_hidden_layers"]
    layer = H * heads * D * 2 + H * kvh * D * 2 + 3 * H * I  # q, o, k, v, gate/up/down
    hyper = len(cfg["hyper_layers"])
    vocab = cfg["vocab_size"]
    P, V = prompt_tokens, frames * T
    lm = 2 * P * L * layer + 2 * P * vocab * H * 0 + hyper * 2 * V * H * 2 * kvh * D \
        + L * 4 * P * P * H + hyper * 4 * P * V * H
    weights_per_token = L * (layer + 2 * H) + H + vocab * H  # layers, norms, final norm, head
    kv_bytes = (hyper * V * 2 * kvh * D + L * P * 2 * kvh * D) * dtype_bytes
    return {"vision_flops": frames * per_frame, "lm_flops": lm,
            "decode_bytes": weights_per_token * dtype_bytes + kv_bytes}


# ---- qa ------------------------------------------------------------------------------------------
def video(work):
    path = Path(work) / "video60.mp4"
    if not path.exists():
        subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                        "testsrc2=size=640x360:rate=30", "-t", "60", "-c:v", "libx264",
                        "-pix_fmt", "yuv420p", str(path)], check=True)
    return path


def qa_row(model, dtype, vid, frames, tokens, limits, repeats):
    cmd = [lvx_bin(), "qa", "--model", str(model), "--video", str(vid), "--question",
           "What is happening in this video?", "--num-frames", str(frames), "--max-new-tokens",
           str(tokens), "--ignore-stop", "--json", "--dtype", dtype]
    runs = []
    for _ in range(repeats):
        out, rss, wall = timed(cmd)
        j = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
        runs.append((j, rss))
    j = runs[0][0]
    t = {k: statistics.median(r[0]["timings"][k] for r in runs) for k in j["timings"]}
    cfg = config_of(model)
    nbytes = 2 if dtype == "bf16" else 4
    c = owl3_counts(cfg, frames, j["prompt_tokens"], nbytes)
    rate = limits[f"gemm_{dtype}_flops"]
    row = {"model": Path(model).name, "dtype": dtype, "frames": frames,
           "prompt_tokens": j["prompt_tokens"], "answer": j["response"],
           "ttft_s": t["ttft_s"], "video_decode_s": t["video_decode_s"], "encode_s": t["encode_s"],
           "prefill_s": t["prefill_s"], "decode_ms_per_token": 1e3 * t["decode_per_token_s"],
           "peak_rss_gb": max(r[1] for r in runs) / 1e9,
           "encode_ratio": c["vision_flops"] / t["encode_s"] / rate,
           "prefill_ratio": (c["vision_flops"] + c["lm_flops"]) / t["prefill_s"] / rate,
           "decode_bound_ms": 1e3 * c["decode_bytes"] / limits["bandwidth"],
           "runs": [r[0]["timings"] for r in runs]}
    row["decode_ratio"] = row["decode_ms_per_token"] / row["decode_bound_ms"]
    row["predicted_rss_gb"] = predicted_peak(model, dtype, frames, j["prompt_tokens"], tokens)
    row["rss_ratio"] = row["peak_rss_gb"] / row["predicted_rss_gb"]
    return row


def predicted_peak(model, dtype, frames, prompt_tokens, tokens):
    """lvx plan's inference memory for the same question (src/planner/inference_memory.h) plus
    the libraries of an lvx process that has loaded nothing: the plan process's own peak RSS (it
    reads only the weight files' headers). The cluster file only sets device figures, which the
    memory does not use."""
    out = Path(tempfile.mkdtemp()) / "plan.json"
    _, rss, _ = timed([lvx_bin(), "plan", "--model", str(model), "--cluster",
                       str(SOURCE / "configs" / "clusters" / "h100_80g_16.yaml"), "--nproc", "1",
                       "--frames", str(frames), "--text", str(prompt_tokens), "--dtype", dtype,
                       "--max-new-tokens", str(tokens), "--json", str(out)])
    return (json.loads(out.read_text())["inference_memory"]["total_bytes"] + rss) / 1e9


# ---- ranks ---------------------------------------------------------------------------------------
RANK_RUNS = (("1 rank", 1, "one"), ("2 ranks, rank 0 decodes", 2, "one"),
             ("2 ranks, every rank decodes", 2, "all"))


def ranks_rows(ckpt_dir, vid, frames, tokens, repeats):
    """lvx qa on the 1B at 1 rank and at 2 (--decode-ranks one and all). First, in fp32 (8
    tokens), the three must give the same tokens (bf16's rounding differs between rank counts, and
    a random model's logits are near ties); then the bf16 runs alternate --repeats times."""
    model = checkpoint(ckpt_dir, "mplug_owl3_1b", "bf16")

    def ask(n, ranks, dtype, count):
        out, rss, _ = timed([lvx_bin(), "qa", "--model", str(model), "--video", str(vid),
                             "--question", "What is happening in this video?", "--num-frames",
                             str(frames), "--max-new-tokens", str(count), "--ignore-stop",
                             "--json", "--dtype", dtype, "--nproc", str(n), "--decode-ranks", ranks])
        return json.loads([l for l in out.splitlines() if l.startswith("{")][-1]), rss

    checked = {name: ask(n, ranks, "fp32", 8)[0]["response"] for name, n, ranks in RANK_RUNS}
    if len(set(checked.values())) != 1:
        raise SystemExit(f"ranks: the fp32 answers differ: {checked}")
    runs = {name: [] for name, _, _ in RANK_RUNS}
    for _ in range(repeats):
        for name, n, ranks in RANK_RUNS:
            runs[name].append(ask(n, ranks, "bf16", tokens))
    spread = lambda xs: {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    rows = []
    for name, n, ranks in RANK_RUNS:
        v = runs[name]
        rows.append({"run": name, "nproc": n, "decode_ranks": ranks,
                     "decode_ms_per_token": spread([1e3 * j["timings"]["decode_per_token_s"] for j, _ in v]),
                     "ttft_s": spread([j["timings"]["ttft_s"] for j, _ in v]),
                     "decode_bytes_per_token": v[0][0]["bytes"]["decode_per_token"],
                     "peak_rss_gb": max(r for _, r in v) / 1e9})
    for r in rows:
        r["decode_vs_1_rank"] = r["decode_ms_per_token"]["median"] / rows[0]["decode_ms_per_token"]["median"]
    return rows


# ---- peers ---------------------------------------------------------------------------------------
def peer_cmd(kind, model, batch, dtype, tokens, out):
    return [sys.executable, str(SOURCE / "benchmarks" / "real_size_peer.py"), "run", kind,
            str(model), str(batch), out, "--dtype", dtype, "--tokens", str(tokens)]


def lvx_generate(model, batch, dtype, tokens, out, nproc=1):
    _, rss, _ = timed([lvx_bin(), "forward", "--model", str(model), "--input", str(batch),
                       "--output", out, "--generate", str(tokens), "--dtype", dtype,
                       "--nproc", str(nproc)])
    from safetensors import safe_open
    with safe_open(out, "pt") as f:
        meta = f.metadata()
        toks = f.get_tensor("tokens")
    return {"prefill_s": float(meta["prefill_seconds"]),
            "encode_s": float(meta.get("encode_seconds", "nan")),
            "decode_ms_per_token": 1e3 * float(meta["decode_seconds_per_token"]),
            "peak_rss_gb": rss / 1e9, "tokens": toks.tolist()}


def peer_run(kind, model, batch, dtype, tokens, out):
    stdout, rss, _ = timed(peer_cmd(kind, model, batch, dtype, tokens, out))
    j = json.loads([l for l in stdout.splitlines() if l.startswith("{")][-1])
    j["peak_rss_gb"] = rss / 1e9
    return j


def peer_inputs(kind, ckpt_dir, work):
    """The release-shaped checkpoint (bf16, as released: an fp32 run converts it as it loads) and
    the peers' batch (real_size_peer.py make-batch)."""
    if kind == "mllama":
        model = checkpoint(ckpt_dir, "llama32_vision_11b", "bf16",
                           ["--layers", "8", "--cross-layers", "3,7"], "-8layers")
    else:
        model = checkpoint(ckpt_dir, "openflamingo_3b", "bf16")
    batch = Path(work) / f"peer_{kind}.safetensors"
    if not batch.exists():
        subprocess.run([sys.executable, str(SOURCE / "benchmarks" / "real_size_peer.py"),
                        "make-batch", kind, str(model), str(batch)], check=True)
    return model, batch


def native_bf16():
    """Whether this CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16): lvx's --dtype auto."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def tiles_rows(ckpt_dir, work, tokens, repeats):
    """lvx forward --generate at Llama-3.2-11B-Vision's widths on the peers' batch, one 2 × 2-tile
    image, at 1 rank and at 2, alternating: from 2 ranks on each rank encodes its share of the
    image's tiles (models/mllama/vision.h encode_tiles). The whole ViT-H; 4 decoder layers (cross
    layer 3) and a 32,000-token vocabulary, so that the weights, mapped once for both ranks, fit
    this machine in fp32 too. In the dtype lvx's --dtype auto picks here (bf16 on CPUs that multiply
    it natively, else fp32), from a checkpoint written in it (used in place). The tiny model's tests
    check exactness (MllamaTilesAcrossRanks); here the tokens are compared and reported (bf16
    rounds differently at another rank count, and a random model's logits are near ties)."""
    dtype = "bf16" if native_bf16() else "fp32"
    model = checkpoint(ckpt_dir, "llama32_vision_11b", dtype,
                       ["--layers", "4", "--cross-layers", "3", "--vocab", "32000"],
                       "-4layers-32k")
    batch = Path(work) / "tiles_mllama.safetensors"
    if not batch.exists():
        subprocess.run([sys.executable, str(SOURCE / "benchmarks" / "real_size_peer.py"),
                        "make-batch", "mllama", str(model), str(batch)], check=True)
    runs = {1: [], 2: []}
    for i in range(repeats):
        for n in (1, 2):
            log(f"[tiles] {dtype} run {i + 1}/{repeats}: {n} rank(s)")
            runs[n].append(lvx_generate(model, batch, dtype, tokens,
                                        str(Path(work) / f"tiles_{n}.st"), nproc=n))
    spread = lambda v: {"median": statistics.median(v), "min": min(v), "max": max(v)}
    rows = [{"nproc": n, "dtype": dtype, "tokens": rs[0]["tokens"],
             **{k: spread([r[k] for r in rs])
                for k in ("prefill_s", "encode_s", "decode_ms_per_token", "peak_rss_gb")}}
            for n, rs in runs.items()]
    for r in rows:
        r["prefill_vs_1_rank"] = r["prefill_s"]["median"] / rows[0]["prefill_s"]["median"]
        r["tokens_equal_1_rank"] = r["tokens"] == rows[0]["tokens"]
    return rows


def peers_row(kind, dtype, ckpt_dir, work, tokens, repeats):
    model, batch = peer_inputs(kind, ckpt_dir, work)
    lvx_runs, peer_runs = [], []
    for i in range(repeats):  # alternating, so the machine's drift moves both alike
        log(f"[peers] {kind} {dtype} run {i + 1}/{repeats}: lvx")
        lvx_runs.append(lvx_generate(model, batch, dtype, tokens, str(Path(work) / "lvx_gen.st")))
        log(f"[peers] {kind} {dtype} run {i + 1}/{repeats}: {kind} peer")
        peer_runs.append(peer_run(kind, model, batch, dtype, tokens, str(Path(work) / "peer.st")))
    same = lvx_runs[0]["tokens"] == peer_runs[0]["tokens"]
    if dtype == "fp32" and not same:
        raise SystemExit(f"{kind} fp32: greedy tokens differ: lvx {lvx_runs[0]['tokens']} "
                         f"peer {peer_runs[0]['tokens']}")

    def med(rs, k):
        v = [r[k] for r in rs]
        return {"median": statistics.median(v), "min": min(v), "max": max(v)}
    return {"kind": kind, "dtype": dtype, "tokens_equal": same,
            "lvx": {k: med(lvx_runs, k) for k in ("prefill_s", "decode_ms_per_token", "peak_rss_gb")},
            "peer": {k: med(peer_runs, k) for k in ("prefill_s", "decode_ms_per_token", "peak_rss_gb")},
            "peer_name": peer_runs[0]["peer"]}


# ---- serve ---------------------------------------------------------------------------------------
def serve_rows(ckpt_dir, clients, requests):
    """bench_serve.py's load on the 1B (fp32, 1 rank): requests/s with continuous batching against
    --max-batch 1, side by side, on 4 cached 6 s videos (3 frames each), 16 tokens a request. In
    fp32, because the run checks that both servers give every answer alike: batched rows round
    differently from one row, and in bf16 that flips greedy tokens of random weights."""
    model = checkpoint(ckpt_dir, "mplug_owl3_1b", "bf16")
    out = subprocess.run([sys.executable, str(SOURCE / "benchmarks" / "bench_serve.py"), "--model",
                          str(model), "--nproc", "1", "--parts", "load", "--clients", clients,
                          "--requests", str(requests), "--load-repeats", "1", "--load-minutes",
                          "0.1", "--tokens", "16", "--minutes", "0.2", "--dtype", "fp32",
                          "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["results"][0]["load"]


# ---- finetune ------------------------------------------------------------------------------------
def finetune_rows(ckpt_dir, stages, worlds, frames, steps):
    """bench_finetune --memory on the 1B: per parallel.shard stage (lora-<stage>: LoRA r16) and rank
    count, samples/s and each rank's peak RSS beside lvx plan's prediction (fp32 training)."""
    model = checkpoint(ckpt_dir, "mplug_owl3_1b", "bf16")
    out = subprocess.run([str(Path(lvx_bin()).parent / "benchmarks" / "bench_finetune"), "--memory",
                          "--model", str(model), "--frames", str(frames), "--steps", str(steps),
                          "--worlds", worlds, "--stages", stages, "--host-gib", "20"],
                         check=True, capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if l.startswith("|") or l.startswith("mPLUG")]


# ---- report --------------------------------------------------------------------------------------
def report(res):
    lim = res.get("limits")
    if lim:
        ways = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in lim["bandwidth_ways"].items()
                         if isinstance(v, float) and k != "fastest")
        print(f"limits ({lim['threads']} threads): GEMM {lim['gemm_fp32_flops'] / 1e9:.0f} GFLOP/s fp32, "
              f"{lim['gemm_bf16_flops'] / 1e9:.0f} GFLOP/s bf16; read bandwidth {lim['bandwidth'] / 1e9:.1f} GB/s "
              f"(the fastest of: {ways})")
    if res.get("qa"):
        print("\n| model | dtype | TTFT s | video decode s | encode s (÷ GEMM rate) | prefill s (÷ GEMM rate) "
              "| decode ms/token (÷ bound) | peak RSS GB (÷ lvx plan's) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in res["qa"]:
            print(f"| {r['model']} | {r['dtype']} | {r['ttft_s']:.2f} | {r['video_decode_s']:.2f} | "
                  f"{r['encode_s']:.2f} ({r['encode_ratio']:.2f}) | {r['prefill_s']:.2f} "
                  f"({r['prefill_ratio']:.2f}) | {r['decode_ms_per_token']:.1f} "
                  f"({r['decode_ratio']:.2f}× of {r['decode_bound_ms']:.1f}) | {r['peak_rss_gb']:.2f} "
                  f"({r['rss_ratio']:.2f} of {r['predicted_rss_gb']:.2f}) |")
    if res.get("serve"):
        print("\n| clients | requests/s, --max-batch 1 | requests/s, batched | batched ÷ one at a time "
              "| TTFT p50 s one / batched | request p99 s one / batched |")
        print("|---|---|---|---|---|---|")
        for key, b in res["serve"].items():
            if b["mode"] != "batched":
                continue
            o = res["serve"][f"{b['clients']} one at a time"]
            print(f"| {b['clients']} | {o['req_per_s']:.2f} | {b['req_per_s']:.2f} | {b['ratio']:.2f} | "
                  f"{o['ttft_p50_s']:.2f} / {b['ttft_p50_s']:.2f} | {o['p99_s']:.2f} / {b['p99_s']:.2f} |")
    if res.get("ranks"):
        print("\n| run | decode ms/token (range) | ÷ 1 rank | TTFT s | decode bytes/token | "
              "peak RSS GB (largest process) |")
        print("|---|---|---|---|---|---|")
        for r in res["ranks"]:
            d = r["decode_ms_per_token"]
            print(f"| {r['run']} | {d['median']:.1f} ({d['min']:.1f}–{d['max']:.1f}) | "
                  f"{r['decode_vs_1_rank']:.2f} | {r['ttft_s']['median']:.2f} | "
                  f"{r['decode_bytes_per_token']} | {r['peak_rss_gb']:.2f} |")
    if res.get("tiles"):
        print(f"\nLlama-3.2-11B-Vision widths, 4 layers, {res['tiles'][0]['dtype']}, one 2 × 2-tile image:")
        print("\n| ranks | prefill s (range) | ÷ 1 rank | of which rank 0's vision encode s | decode "
              "ms/token | peak RSS GB (largest process) | tokens equal 1 rank's |")
        print("|---|---|---|---|---|---|---|")
        for r in res["tiles"]:
            p = r["prefill_s"]
            print(f"| {r['nproc']} | {p['median']:.1f} ({p['min']:.1f}–{p['max']:.1f}) | "
                  f"{r['prefill_vs_1_rank']:.2f} | {r['encode_s']['median']:.1f} | "
                  f"{r['decode_ms_per_token']['median']:.0f} | {r['peak_rss_gb']['median']:.1f} | "
                  f"{r['tokens_equal_1_rank']} |")
    if res.get("finetune"):
        print()
        print("\n".join(res["finetune"]))
    if res.get("peers"):
        print("\n| model | dtype | system | prefill s | decode ms/token | peak RSS GB | lvx ÷ peer "
              "(prefill, decode) | tokens equal |")
        print("|---|---|---|---|---|---|---|---|")
        for r in res["peers"]:
            for who in ("lvx", "peer"):
                m = r[who]
                fmt = lambda k, f: f"{m[k]['median']:{f}} ({m[k]['min']:{f}}–{m[k]['max']:{f}})"
                ratio = ""
                if who == "lvx":
                    ratio = (f"{r['lvx']['prefill_s']['median'] / r['peer']['prefill_s']['median']:.2f}, "
                             f"{r['lvx']['decode_ms_per_token']['median'] / r['peer']['decode_ms_per_token']['median']:.2f}")
                print(f"| {r['kind']} | {r['dtype']} | {'lvx' if who == 'lvx' else r['peer_name']} | "
                      f"{fmt('prefill_s', '.2f')} | {fmt('decode_ms_per_token', '.0f')} | "
                      f"{fmt('peak_rss_gb', '.1f')} | {ratio} | {r['tokens_equal'] if who == 'lvx' else ''} |")


def save(res, path):
    """The results so far (a part that fails later loses nothing measured before it)."""
    if path:
        Path(path).write_text(json.dumps(res, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="qa,ranks,serve,finetune,peers")
    ap.add_argument("--ranks-frames", type=int, default=2)
    ap.add_argument("--qa", default="1b:bf16,1b:fp32,2b:bf16,7b:bf16")
    ap.add_argument("--peers", default="openflamingo:fp32,openflamingo:bf16,mllama:fp32,mllama:bf16")
    ap.add_argument("--finetune-stages", default="lora-parameters,parameters")
    ap.add_argument("--finetune-worlds", default="2")
    ap.add_argument("--finetune-frames", type=int, default=2)
    ap.add_argument("--finetune-steps", type=int, default=3)
    ap.add_argument("--serve-clients", default="1,4,16")
    ap.add_argument("--serve-requests", type=int, default=32)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--peer-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ckpt-dir", default=os.path.expanduser("~/.cache/lvx/real-size"))
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "lvx-bench-real-size"))
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    parts = a.parts.split(",")
    res = {"machine": os.uname().nodename, "date": time.strftime("%Y-%m-%d %H:%M")}
    if {"qa", "peers"} & set(parts):  # their ratios need them: measured in the same run
        res["limits"] = machine_limits(a.threads)
    if "qa" in parts:
        res["qa"] = []
        vid = video(a.work)
        for spec in a.qa.split(","):
            size, dtype = spec.split(":")
            model = checkpoint(a.ckpt_dir, QA_MODELS[size], "bf16")  # the releases' dtype
            log(f"[qa] {size} {dtype}")
            res["qa"].append(qa_row(model, dtype, vid, a.frames, a.tokens, res["limits"], a.repeats))
            save(res, a.json)
    if "ranks" in parts:
        log("[ranks] 1b bf16 at 1 and 2 ranks")
        res["ranks"] = ranks_rows(a.ckpt_dir, video(a.work), a.ranks_frames, a.tokens, a.repeats)
        save(res, a.json)
    if "tiles" in parts:
        log("[tiles] Llama-3.2-11B-Vision widths at 1 and 2 ranks")
        res["tiles"] = tiles_rows(a.ckpt_dir, a.work, a.peer_tokens, a.repeats)
        save(res, a.json)
    if "serve" in parts:
        log("[serve] 1b bf16")
        res["serve"] = serve_rows(a.ckpt_dir, a.serve_clients, a.serve_requests)
        save(res, a.json)
    if "finetune" in parts:
        log("[finetune] 1b fp32")
        res["finetune"] = finetune_rows(a.ckpt_dir, a.finetune_stages, a.finetune_worlds,
                                        a.finetune_frames, a.finetune_steps)
        save(res, a.json)
    if "peers" in parts:
        res["peers"] = []
        for spec in a.peers.split(","):
            kind, dtype = spec.split(":")
            res["peers"].append(peers_row(kind, dtype, a.ckpt_dir, a.work, a.peer_tokens, a.repeats))
            save(res, a.json)
    report(res)


if __name__ == "__main__":
    main()
