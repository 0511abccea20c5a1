"""lvx serve benchmark: time to first token for the first and a repeated question about a long
video (the visual cache), and requests/s with p50/p99 latency at several concurrent clients.

  python bench_serve.py [--nproc 1,2] [--minutes 60] [--video-fps 1] [--sample-fps 0.5]
                        [--clients 1,4,16] [--requests 256] [--load-repeats 5] [--tokens 16]
                        [--max-batch 16] [--probe-chunks 0,32/0,32/131072,...]
                        [--load-minutes 2] [--parts ttft,load,probe,budget] [-o md|json]

Model: --model DIR, else a tiny random mPLUG-Owl3 (tests/reference/mplug_owl3_ref.py make-model: SigLIP 32 px,
16 visual tokens per frame), so the numbers measure lvx's video path, prefill and serving, not a
real checkpoint's FLOPs. Video: ffmpeg's testsrc2 at 64x48, --video-fps, --minutes long (libx264,
default GOP), sampled at --sample-fps (1 hour at 0.5 fps: 1800 frames, 28 800 visual keys).
Correctness first: the served answer (first and repeated) must equal `lvx qa --json` on the same
video, frames and question, or the run stops. Time to first token is the client's (request sent
→ first content chunk of the stream), median of --repeats runs; "first" runs are cache misses
forced by a range ending a millisecond earlier each (the cache keys by content and range; the file
is the same, so the OS page cache is warm for all but the very first), "repeat" runs hit (keyed
by the file's content hash: hashing is included).
Throughput (continuous batching): every client sends its requests back to back on one kept-alive
connection (as the openai package's clients do), streamed, each
a distinct question (request i asks its own) about one of 4 short cached videos (--load-minutes
each, testsrc2 in 4 sizes), greedy, --tokens new tokens. Two servers side by side in one run: the
default (up to --max-batch generations step together, one decode step for all) and --max-batch 1
(one generation at a time: the peer a user would otherwise run), --load-repeats runs each,
alternating. Reported: requests/s (the median run; every run in the JSON output), the ratio
batched / one at a time as the median of each repeat's pair of runs (adjacent in time: this
machine's drift moves both alike; the median of each server's runs can pair a fast run with a
slow one), and p50/p99 of
the client's time to first token and of the whole request over all runs. Every answer must be the same on
both servers (the batched rows' logits differ from alone by ~1e-6; a greedy token that flipped
would stop the run).
Prefill under load: the time to first token of a short question about a cached video asked (back
to back) while a 1-hour video's first prefill (a cache miss) runs, against the same question on
the idle server, for several --max-batch-tokens and --max-batch-visual-keys (--probe-chunks:
TOKENS/KEYS entries; tokens 0: the prompt whole, which the short questions wait for; keys 0: no
bound on the visual keys a chunk reads): the miss's frames are decoded and encoded on a worker thread of each
rank, and its prompt runs one chunk between two decode steps.
"""
import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import serve_budget
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from serve_setup import bench_paths, start_serve

QUESTION = "What colour was the shape?"


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


class Server:
    def __init__(self, lvx, model, nproc, media, sample_fps, tokens, flags=()):
        self.proc, self.port = start_serve(
            [lvx, "serve", "--model", model, "--served-model-name", "model", "--nproc", str(nproc),
             "--port", "0",
             "--allowed-local-media-path", media, "--fps", str(sample_fps),
             "--max-new-tokens", str(tokens), "--max-queue", "256", *flags])

    def post(self, body, stream=False):
        """(seconds to the first content, seconds in all, text, response JSON or None), on a new
        connection (Connections.post: on the thread's kept one)."""
        req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % self.port,
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            return read_answer(r, stream, t0)

    def metric(self, name):
        """A counter of /metrics (no key: the benchmark's servers run on loopback without one)."""
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.port, timeout=60) as r:
            return int(float(re.search(r"^%s (\S+)" % name, r.read().decode(), re.M).group(1)))

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


def read_answer(r, stream, t0):
    """post's tuple from the response `r` to a request sent at t0."""
    if not stream:
        out = json.loads(r.read())
        t = time.perf_counter() - t0
        return t, t, out["choices"][0]["message"]["content"], out
    first, text = None, ""
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        for c in ev.get("choices", []):
            piece = c["delta"].get("content") or ""
            if piece and first is None:
                first = time.perf_counter() - t0
            text += piece
    total = time.perf_counter() - t0
    return first if first is not None else total, total, text, None


class Connections:
    """One kept-alive HTTP connection per client thread, as the clients users run keep theirs
    (the openai package's httpx pool, lmms-eval through it): a load run's requests then cost no
    TCP set-up each. One per run (its threads are that run's); close() ends them."""

    def __init__(self, port):
        self.port, self.local, self.all, self.lock = port, threading.local(), [], threading.Lock()

    def post(self, body, stream):
        c = getattr(self.local, "conn", None)
        if c is None:
            c = self.local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            with self.lock:
                self.all.append(c)
        t0 = time.perf_counter()
        c.request("POST", "/v1/chat/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200, ("HTTP %d" % r.status, r.read()[:200])
        out = read_answer(r, stream, t0)
        if (r.getheader("Connection") or "").lower() == "close":  # the server ended it
            c.close()
            self.local.conn = None
        return out

    def close(self):
        for c in self.all:
            c.close()


def body(video, tokens, stream=False, miss=None, question=QUESTION, end=None):
    """A request; miss=k forces a visual-cache miss (the cache keys by content and range, not by
    video_id: the range ends k+1 ms before `end`, the video's length, so its frames are the same
    but its key is new)."""
    b = {"model": "model", "temperature": 0, "max_tokens": tokens, "stream": stream,
         "messages": [{"role": "user", "content": [
             {"type": "video_url", "video_url": {"url": "file://" + video}},
             {"type": "text", "text": question}]}]}
    if miss is not None:
        b["end"] = end - 0.001 * (miss + 1)
    return b


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def load_videos(media, minutes):
    """Four short videos of distinct content (testsrc2 in four sizes), made once."""
    out = []
    for w, h in ((64, 48), (80, 48), (64, 64), (96, 48)):
        v = media / ("load_%dx%d_%gmin.mp4" % (w, h, minutes))
        if not v.exists():
            sh("ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
               "testsrc2=size=%dx%d:rate=4" % (w, h), "-t", str(minutes * 60), "-c:v", "libx264",
               "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(v))
        out.append(str(v))
    return out


def load_run(a, srv, videos, clients, n):
    """n distinct streamed questions (request i asks its own, about video i mod 4) from `clients`
    clients on kept connections: (requests/s, [(question, post's tuple)])."""
    conns = Connections(srv.port)

    def one(i):
        q = "%s (%d)" % (QUESTION, i)
        return q, conns.post(body(videos[i % len(videos)], a.tokens, True, question=q), True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        outs = list(ex.map(one, range(n)))
    rps = n / (time.perf_counter() - t0)
    conns.close()
    return rps, outs


def load_rows(a, lvx, model, nproc, media, videos):
    """Requests/s and TTFT with continuous batching and with --max-batch 1, side by side."""
    dtype = ["--dtype", a.dtype]
    servers = {"batched": Server(lvx, str(model), nproc, str(media), a.sample_fps, a.tokens,
                                 ["--max-batch", str(a.max_batch)] + dtype),
               "one at a time": Server(lvx, str(model), nproc, str(media), a.sample_fps, a.tokens,
                                       ["--max-batch", "1"] + dtype)}
    rows, answers = {}, {}
    try:
        for s in servers.values():
            for v in videos:  # every video cached on every server first
                s.post(body(v, 1))
        for c in [int(x) for x in a.clients.split(",")]:
            n = max(a.requests, c)
            runs = {mode: [] for mode in servers}
            for _ in range(a.load_repeats):  # the two servers alternate: drifts hit both
                for mode, s in servers.items():
                    runs[mode].append(load_run(a, s, videos, c, n))
            for mode, done in runs.items():
                outs = [o for _, run in done for o in run]
                for q, o in outs:
                    assert answers.setdefault(q, o[2]) == o[2], ("an answer differs", mode, q)
                ttft, lat = [o[0] for _, o in outs], [o[1] for _, o in outs]
                rows["%d %s" % (c, mode)] = {
                    "clients": c, "mode": mode, "requests": n,
                    "req_per_s": statistics.median(r for r, _ in done),
                    "req_per_s_runs": [r for r, _ in done],
                    "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": pct(ttft, 99),
                    "p50_s": statistics.median(lat), "p99_s": pct(lat, 99)}
            # Each repeat's two runs ran back to back: their ratio shares the machine's drift,
            # which moves either server's requests/s by tens of percent between repeats here.
            pairs = [b / o for (b, _), (o, _) in zip(runs["batched"], runs["one at a time"])]
            rows["%d batched" % c].update(ratio=statistics.median(pairs), ratio_runs=pairs)
    finally:
        for s in servers.values():
            s.stop()
    return rows


def open_loop(a, srv, long_body, short_body):
    """Sends `long_body` and, from 50 ms after it, `short_body` every --probe-every seconds, each
    on its own connection (open loop: none waits for another's answer, so every moment of the long
    request is sampled alike, its stalls included), until the long one is answered. Returns its
    time to first token, its text, and (seconds after the start it was sent, time to first token)
    of each short one."""
    with ThreadPoolExecutor(1) as long_ex, ThreadPoolExecutor(16) as ex:
        t0 = time.perf_counter()
        miss = long_ex.submit(srv.post, long_body, True)

        def short(s):
            time.sleep(max(0.0, s - (time.perf_counter() - t0)))
            s = time.perf_counter() - t0
            return s, srv.post(short_body, True)[0]
        shorts, k = [], 0
        while not miss.done():
            s = 0.05 + k * a.probe_every
            if s > time.perf_counter() - t0 + 0.5:  # keep a little ahead
                time.sleep(0.01)
                continue
            shorts.append(ex.submit(short, s))
            k += 1
        long_ttft, _, long_text, _ = miss.result()
        return long_ttft, long_text, [f.result() for f in shorts]


def prefill_probe(a, lvx, model, nproc, media, long_video, short_video, length):
    """TTFT of a short question about a cached video, idle and while a 1-hour video's first
    prefill (a cache miss) runs, for each TOKENS/KEYS of --probe-chunks (--max-batch-tokens and
    --max-batch-visual-keys; tokens 0: the prompt whole), one server each, side by side. A short question (one token) is sent every
    --probe-every seconds from 50 ms after the miss (open loop: each on its own connection); those
    sent before the miss's first token count. The miss's answer must equal lvx qa's with the same
    chunk flags."""
    rows = []
    for entry in a.probe_chunks.split(","):
        chunk, keys = (int(x) for x in (entry.split("/") + ["0"])[:2])
        flags = ["--max-batch-tokens", str(chunk), "--max-batch-visual-keys", str(keys)]
        want = qa_answer(a, lvx, model, long_video, nproc, flags)
        srv = Server(lvx, str(model), nproc, str(media), a.sample_fps, a.tokens, flags)
        try:
            srv.post(body(short_video, 1))
            # One token each: the time to it is what is measured, and a short question's later
            # tokens would space the samples one chunk apart per token.
            idle = [srv.post(body(short_video, 1, True), True)[0] for _ in range(5)]
            chunks0 = srv.metric("lvx_prefill_chunks_total")
            long_ttft, long_text, spans = open_loop(
                a, srv, body(long_video, a.tokens, True, 300, end=length), body(short_video, 1, True))
            assert long_text == want["response"], ("the 1-hour answer differs from lvx qa's",
                                                   entry, long_text, want["response"])
            busy = [t for s, t in spans if s < long_ttft] or [float("nan")]
            rows.append({"max_batch_tokens": chunk, "max_batch_visual_keys": keys,
                         "chunks": srv.metric("lvx_prefill_chunks_total") - chunks0,
                         "idle_ttft_s": statistics.median(idle),
                         "busy_ttft_p50_s": statistics.median(busy), "busy_ttft_max_s": max(busy),
                         "busy_samples": len(busy),
                         "ratio": statistics.median(busy) / statistics.median(idle),
                         "long_ttft_s": long_ttft})
        finally:
            srv.stop()
    return rows


def qa_answer(a, lvx, model, video, nproc, flags):
    """lvx qa --json of the benchmark's question about `video` with the chunk flags given."""
    return json.loads(subprocess.run(
        [lvx, "qa", "--model", str(model), "--video", str(video), "--question", QUESTION,
         "--fps", str(a.sample_fps), "--max-new-tokens", str(a.tokens), "--json", "--nproc",
         str(nproc)] + flags,
        check=True, capture_output=True, text=True).stdout)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", default="1,2")
    ap.add_argument("--dtype", default="auto", help="the servers' --dtype")
    ap.add_argument("--model", default="",
                    help="a checkpoint directory (default: the tiny random mPLUG-Owl3); "
                         "bench_real_size.py passes a release-shaped one")
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--video-fps", type=float, default=1)
    ap.add_argument("--sample-fps", type=float, default=0.5)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=256,
                    help="requests per concurrency level and run (16 per client at 16 clients: "
                         "the batch runs full, not mostly filling up and draining)")
    ap.add_argument("--load-repeats", type=int, default=5,
                    help="runs per concurrency level and server, alternating; requests/s is "
                         "their median, batched / one at a time the median of each repeat's "
                         "pair, the latencies are pooled")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=16, help="the batched server's --max-batch")
    ap.add_argument("--max-batch-tokens", type=int, default=32,
                    help="the servers' --max-batch-tokens (lvx serve's default)")
    ap.add_argument("--probe-chunks", default="0,32/0,16/0,32/262144,32/131072,32/65536",
                    help="TOKENS/KEYS: --max-batch-tokens (0: whole) and --max-batch-visual-keys "
                         "(0: no bound) of each prefill-under-load server")
    ap.add_argument("--probe-every", type=float, default=0.05,
                    help="seconds between the short questions asked during the 1-hour prefill")
    ap.add_argument("--load-minutes", type=float, default=2,
                    help="length of each of the 4 videos the load asks about")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "lvx_bench_serve"))
    ap.add_argument("--parts", default="ttft,load,probe",
                    help="what to measure: ttft (the first and a repeated question about the long "
                         "video), load (requests/s batched against one at a time), probe (a short "
                         "question's TTFT during the long video's prefill), budget (--max-kv-bytes "
                         "under 16 and 64 clients and during the long prefill: serve_budget.py)")
    ap.add_argument("-o", "--output", default="md", choices=["md", "json"])
    a = ap.parse_args()
    a.parts = set(a.parts.split(","))
    return a


def long_video(a, media):
    """The long test video (--minutes of testsrc2 at --video-fps), made once."""
    video = media / ("long_%gmin_%gfps.mp4" % (a.minutes, a.video_fps))
    if not video.exists():
        t0 = time.time()
        sh("ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
           "testsrc2=size=64x48:rate=%g" % a.video_fps, "-t", str(a.minutes * 60), "-c:v",
           "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", str(video))
        print("made %s (%.1f MB) in %.1f s" % (video, video.stat().st_size / 1e6, time.time() - t0),
              file=sys.stderr)
    return video


def first_and_repeat(a, srv, want, video, nproc, length):
    """Time to first token of the long video's first question (cold, then forced misses) and of
    a repeat (a visual-cache hit), each answer checked against lvx qa's; and where a miss's and
    a hit's time goes (the slowest rank's, from the response's lvx timings)."""
    first = [srv.post(body(str(video), a.tokens, True), True)]
    for k in range(a.repeats - 1):
        first.append(srv.post(body(str(video), a.tokens, True, k, end=length), True))
    repeat = [srv.post(body(str(video), a.tokens, True), True) for _ in range(a.repeats)]
    for t in first + repeat:
        assert t[2] == want["response"], ("answer differs from lvx qa", t[2], want)
    row = {"ttft_first_s": statistics.median(t[0] for t in first),
           "ttft_first_cold_s": first[0][0],
           "ttft_repeat_s": statistics.median(t[0] for t in repeat)}
    row["repeat_over_first"] = row["ttft_repeat_s"] / row["ttft_first_s"]
    miss = srv.post(body(str(video), a.tokens, miss=100, end=length))[3]["lvx"]
    hit = srv.post(body(str(video), a.tokens, miss=100, end=length))[3]["lvx"]
    assert miss["visual_cache"]["misses"] == nproc and hit["visual_cache"]["hits"] == nproc
    for name, t in (("miss", miss["timings"]), ("hit", hit["timings"])):
        row[name] = {k: t[k] for k in ("video_decode_s", "encode_s", "prefill_s", "ttft_s")}
    return row


def ranks_row(a, lvx, model, media, video, videos, nproc):
    """Every part of --parts at `nproc` ranks: one server (the default, --max-batch-tokens as
    given) for the first/repeat question, the load's own servers, the probe's own servers."""
    length = a.minutes * 60  # seconds
    chunks = ["--max-batch-tokens", str(a.max_batch_tokens)]
    row = {"ranks": nproc}
    if a.parts & {"ttft", "load"}:
        want = qa_answer(a, lvx, model, video, nproc, chunks)
        row.update({"frames": want["frames"], "prompt_tokens": want["prompt_tokens"],
                    "qa_ttft_s": want["timings"]["ttft_s"]})
    if "ttft" in a.parts:
        srv = Server(lvx, str(model), nproc, str(media), a.sample_fps, a.tokens, chunks)
        try:
            row.update(first_and_repeat(a, srv, want, video, nproc, length))
        finally:
            srv.stop()
    if "load" in a.parts:
        row["load"] = load_rows(a, lvx, model, nproc, media, videos)
    if "probe" in a.parts:
        row["under_prefill"] = prefill_probe(a, lvx, model, nproc, media, str(video), videos[0],
                                             length)
    if "budget" in a.parts:  # mixed lengths: the 4 short videos and a longer one
        mixed = videos + load_videos(media, 4 * a.load_minutes)[:1]
        row["budget"] = serve_budget.budget_rows(a, lvx, model, nproc, media, str(video), mixed,
                                                 length, sys.modules[__name__])
    return row


def print_ttft(results):
    print("| ranks | frames | TTFT first (cold) s | TTFT first (median) s | TTFT repeat s | "
          "repeat / first | lvx qa TTFT s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print("| %d | %d | %.3f | %.3f | %.3f | %.3f | %.3f |" % (
            r["ranks"], r["frames"], r["ttft_first_cold_s"], r["ttft_first_s"],
            r["ttft_repeat_s"], r["repeat_over_first"], r["qa_ttft_s"]))
    print()
    print("| ranks | | video decode s | encode s | prefill s (encode included) | server TTFT s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        for name in ("miss", "hit"):
            t = r[name]
            print("| %d | %s | %.3f | %.3f | %.3f | %.3f |" % (
                r["ranks"], name, t["video_decode_s"], t["encode_s"], t["prefill_s"], t["ttft_s"]))
    print()


def print_load(results):
    print("| ranks | clients | requests | requests/s one at a time | requests/s batched | "
          "batched / one (median of the repeats' pairs; range) | TTFT p50 s one | "
          "TTFT p50 s batched | TTFT p99 s one | TTFT p99 s batched | p99 s one | p99 s batched |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for key, b in r["load"].items():
            if b["mode"] != "batched":
                continue
            o = r["load"]["%d one at a time" % b["clients"]]
            print("| %d | %d | %d | %.2f | %.2f | %.2f (%.2f-%.2f) | %.3f | %.3f | %.3f | %.3f | "
                  "%.3f | %.3f |"
                  % (r["ranks"], b["clients"], b["requests"], o["req_per_s"], b["req_per_s"],
                     b["ratio"], min(b["ratio_runs"]), max(b["ratio_runs"]),
                     o["ttft_p50_s"], b["ttft_p50_s"],
                     o["ttft_p99_s"], b["ttft_p99_s"], o["p99_s"], b["p99_s"]))
    print()


def print_probe(results):
    print("| ranks | --max-batch-tokens | --max-batch-visual-keys | chunks | short question TTFT "
          "idle s | during a 1-hour prefill: p50 s | max s | samples | p50 / idle | the 1-hour "
          "question's TTFT s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for p in r["under_prefill"]:
            print("| %d | %s | %s | %d | %.3f | %.3f | %.3f | %d | %.1f | %.3f |" % (
                r["ranks"], p["max_batch_tokens"] or "0 (whole)",
                p["max_batch_visual_keys"] or "0 (none)", p["chunks"], p["idle_ttft_s"],
                p["busy_ttft_p50_s"], p["busy_ttft_max_s"], p["busy_samples"], p["ratio"],
                p["long_ttft_s"]))
    print()


def main():
    a = parse_args()
    lvx, work, media, model = bench_paths(a.workdir)
    if a.model:
        model = Path(a.model)
    video = long_video(a, media)
    videos = load_videos(media, a.load_minutes)
    results = [ranks_row(a, lvx, model, media, video, videos, int(n))
               for n in a.nproc.split(",")]
    load = os.getloadavg()[0]
    if a.output == "json":
        print(json.dumps({"results": results, "loadavg_1min_at_end": load}, indent=1))
        return
    for part, table in (("ttft", print_ttft), ("load", print_load), ("probe", print_probe),
                        ("budget", serve_budget.print_budget)):
        if part in a.parts:
            table(results)
    print("(load average at the end: %.1f)" % load)


if __name__ == "__main__":
    main()
