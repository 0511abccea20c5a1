"""bench_serve.py's `budget` part: lvx serve admitting by KV bytes (--max-kv-bytes) under 16 and 64
concurrent clients asking about videos of mixed lengths, and a short question's time to first
token while a 1-hour video is prefilled under the same budget.

The costs are read from the server itself: a server with --max-kv-bytes 1 refuses every request
with a 400 naming its cost ("needs N bytes"), known before any frame is decoded. The load's server
has a budget of 8 of the largest load requests (16 and 64 clients, 3 runs each, alternating:
requests wait for room, at most 8 run at once); the probe's has the 1-hour question's cost plus 8
of them. While each load runs, /metrics' lvx_kv_bytes is read every 20 ms: its peak must stay
within the budget (checked, the run stops otherwise). Every answer of the load must be the same
in every run (greedy), and the 1-hour question's must equal lvx qa's.
Goals (issue "serve tenants"): no request above the budget; requests/s at 64 clients at least the
16-client figure; p99 time to first token of a short question during the 1-hour prefill ≤ 2×
the idle one.
"""
import json
import re
import statistics
import threading
import time
import urllib.error

PROBE_FLAGS = ["--max-batch-tokens", "32", "--max-batch-visual-keys", "131072"]


def cost_of(srv, body):
    """The KV bytes per rank a server with --max-kv-bytes 1 says the request needs."""
    try:
        srv.post(body)
    except urllib.error.HTTPError as e:
        msg = json.loads(e.read())["error"]["message"]
        return int(re.search(r"needs (\d+) bytes", msg).group(1))
    raise AssertionError("a server with --max-kv-bytes 1 answered a request")


class KvWatch:
    """The peak of lvx_kv_bytes, read every 20 ms while the load runs."""

    def __init__(self, srv):
        self.srv, self.peak, self.stop_ = srv, 0, threading.Event()
        self.t = threading.Thread(target=self.run)
        self.t.start()

    def run(self):
        while not self.stop_.is_set():
            self.peak = max(self.peak, self.srv.metric("lvx_kv_bytes"))
            time.sleep(0.02)

    def stop(self):
        self.stop_.set()
        self.t.join()
        return self.peak


def budget_rows(a, lvx, model, nproc, media, long_video, videos, length, b):
    """b: bench_serve's helpers (Server, Connections, body, pct, qa_answer, QUESTION)."""
    probe = b.Server(lvx, str(model), nproc, str(media), a.sample_fps, a.tokens,
                     ["--max-kv-bytes", "1"])
    try:
        short_cost = max(cost_of(probe, b.body(v, a.tokens)) for v in videos)
        long_cost = cost_of(probe, b.body(long_video, a.tokens, end=length))
    finally:
        probe.stop()
    row = {"short_cost_bytes": short_cost, "long_cost_bytes": long_cost,
           "budget_bytes": 8 * short_cost, "probe_budget_bytes": long_cost + 8 * short_cost}
    srv = b.Server(lvx, str(model), nproc, str(media), a.sample_fps, a.tokens,
                   ["--max-kv-bytes", str(row["budget_bytes"]), "--max-batch", str(a.max_batch)])
    try:
        row["load"] = load_under_budget(a, srv, videos, row["budget_bytes"], b)
    finally:
        srv.stop()
    srv = b.Server(lvx, str(model), nproc, str(media), a.sample_fps, a.tokens,
                   ["--max-kv-bytes", str(row["probe_budget_bytes"]), "--max-batch",
                    str(a.max_batch)] + PROBE_FLAGS)
    try:
        row["probe"] = probe_under_budget(a, srv, long_video, videos[0], length, b)
    finally:
        srv.stop()
    want = b.qa_answer(a, lvx, model, long_video, nproc, PROBE_FLAGS)
    assert row["probe"].pop("long_text") == want["response"], "the 1-hour answer differs"
    return row


def load_under_budget(a, srv, videos, budget, b):
    """Requests/s and TTFT at 16 and 64 clients, 3 runs each alternating, the KV peak watched."""
    for v in videos:
        srv.post(b.body(v, 1))  # cached first, as the load part does
    answers, runs = {}, {16: [], 64: []}
    for _ in range(3):
        for clients in (16, 64):
            watch = KvWatch(srv)
            rps, outs = b.load_run(a, srv, videos, clients, max(a.requests, clients))
            peak = watch.stop()
            assert peak <= budget, ("KV bytes above the budget", peak, budget)
            for q, o in outs:
                assert answers.setdefault(q, o[2]) == o[2], ("an answer differs", clients, q)
            runs[clients].append((rps, peak, [o[0] for _, o in outs]))
    out = {}
    for clients, rs in runs.items():
        ttft = [t for _, _, ts in rs for t in ts]
        out[clients] = {"requests": max(a.requests, clients),
                        "req_per_s": statistics.median(r for r, _, _ in rs),
                        "req_per_s_runs": [r for r, _, _ in rs],
                        "kv_peak_bytes": max(p for _, p, _ in rs),
                        "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": b.pct(ttft, 99)}
    out["ratio_runs"] = [x[0] / y[0] for x, y in zip(runs[64], runs[16])]
    return out


def probe_under_budget(a, srv, long_video, short_video, length, b):
    """A short question (one token) every --probe-every seconds while the 1-hour question's
    prefill runs, against the same question on the idle server."""
    idle = [srv.post(b.body(short_video, 1, True), True)[0] for _ in range(9)]
    long_ttft, long_text, spans = b.open_loop(
        a, srv, b.body(long_video, a.tokens, True, 301, end=length), b.body(short_video, 1, True))
    busy = [t for s, t in spans if s < long_ttft] or [float("nan")]
    idle_p50 = statistics.median(idle)
    return {"idle_ttft_p50_s": idle_p50, "idle_ttft_p99_s": b.pct(idle, 99),
            "busy_ttft_p50_s": statistics.median(busy), "busy_ttft_p99_s": b.pct(busy, 99),
            "samples": len(busy), "p99_over_idle": b.pct(busy, 99) / idle_p50,
            "long_ttft_s": long_ttft, "long_text": long_text}


def print_budget(results):
    print("| ranks | --max-kv-bytes (8 of the largest) | clients | requests | requests/s (median; "
          "range) | KV peak / budget | TTFT p50 s | TTFT p99 s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        g = r["budget"]
        for c in (16, 64):
            l = g["load"][c]
            print("| %d | %d | %d | %d | %.2f (%.2f-%.2f) | %.3f | %.3f | %.3f |" % (
                r["ranks"], g["budget_bytes"], c, l["requests"], l["req_per_s"],
                min(l["req_per_s_runs"]), max(l["req_per_s_runs"]),
                l["kv_peak_bytes"] / g["budget_bytes"], l["ttft_p50_s"], l["ttft_p99_s"]))
        rr = g["load"]["ratio_runs"]
        print("\n64 clients over 16: %.2fx requests/s (median of the adjacent pairs; %.2f-%.2f; "
              "goal >= 1)" % (statistics.median(rr), min(rr), max(rr)))
        p = g["probe"]
        print("short question during the 1-hour prefill, under the budget: TTFT p50 %.3f s, p99 "
              "%.3f s over %d samples; idle p50 %.3f s; p99 / idle = %.2f (goal <= 2); the 1-hour "
              "question's TTFT %.2f s\n" % (p["busy_ttft_p50_s"], p["busy_ttft_p99_s"],
                                           p["samples"], p["idle_ttft_p50_s"],
                                           p["p99_over_idle"], p["long_ttft_s"]))
