"""lvx serve under many large uploads at once: resident memory against --max-inflight-bytes.

  python bench_serve_load.py [--clients 64] [--mb 50] [--slow 16] [--budget-mb 512]
                             [--peer-clients 16] [--nproc 1] [-o md|json]

Each of --clients clients POSTs a --mb MB video as a data URL (random bytes: the server reads the
body, parses it, decodes the base64, broadcasts it and writes it for the ranks, then FFmpeg
refuses it: a 400 naming the upload) while --slow clients connect and send nothing. A client
sends its headers first and waits 0.2 s for an early refusal (429 from the budget, answered from
the headers before the body is read) before it sends the body. Measured: the server's resident
memory (every process of it: launcher and ranks, /proc every 20 ms), peak over the run, and the
answers by status. Side by side in one run: the same load against a server whose budget holds
every request at once (--max-inflight-bytes 1 TB, the behaviour before the budget) with
--peer-clients clients (fewer: without a budget 64 x 50 MB uploads would need ~15 GB here).
Correctness first: before each load the server answers a real clip as `lvx qa` does; after it,
it answers again and holds no request bytes (lvx_inflight_bytes 0).
Model: the tiny random mPLUG-Owl3 of bench_serve.py.
"""
import argparse
import base64
import json
import os
import re
import select
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from serve_setup import bench_paths, start_serve

QUESTION = "What colour was the shape?"


def tree_rss(pid):
    """Resident bytes of `pid` and its descendants."""
    children = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    total, todo = 0, [pid]
    while todo:
        q = todo.pop()
        todo += children.get(q, [])
        try:
            m = re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/%d/status" % q).read_text())
            total += int(m.group(1)) * 1024 if m else 0
        except OSError:
            pass
    return total


class Server:
    def __init__(self, lvx, model, media, nproc, budget):
        self.proc, self.port = start_serve(
            [lvx, "serve", "--model", model, "--nproc", str(nproc), "--port", "0",
             "--allowed-local-media-path", media, "--num-frames", "4", "--max-new-tokens", "8",
             "--max-inflight-bytes", str(budget), "--max-queue", "128",
             "--max-body-bytes", str(1 << 30)])

    def get(self, path):
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.port, path), timeout=60) as r:
            return r.read().decode()

    def ask(self, url):
        body = {"model": "model", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": QUESTION}]}]}
        req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % self.port,
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]

    def held(self):
        return float(re.search(r"^lvx_inflight_bytes (\S+)", self.get("/metrics"), re.M).group(1))

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=120)


def upload(port, body, out):
    """One client: headers, an early refusal or the body, then the status."""
    head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: %d\r\n\r\n" % len(body)).encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=300) as sk:
            sk.sendall(head)
            if not select.select([sk], [], [], 0.2)[0]:
                sk.sendall(body)
            data = b""
            while b"\r\n" not in data:
                chunk = sk.recv(4096)
                if not chunk:
                    break
                data += chunk
            out.append(int(data.split()[1]) if data else "closed")
    except OSError as e:
        out.append(type(e).__name__)


def run_load(srv, clients, slow, body):
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss(srv.proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(slow)]
    out = []
    t0 = time.time()
    threads = [threading.Thread(target=upload, args=(srv.port, body, out)) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    for sk in idle:
        sk.close()
    stop.set()
    sampler.join()
    counts = {}
    for s in out:
        counts[str(s)] = counts.get(str(s), 0) + 1
    return {"peak_rss_bytes": peak[0], "wall_s": wall, "answers": counts}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--mb", type=float, default=50)
    ap.add_argument("--slow", type=int, default=16)
    ap.add_argument("--budget-mb", type=float, default=512)
    ap.add_argument("--peer-clients", type=int, default=16)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "lvx_bench_serve"))
    ap.add_argument("-o", "--output", default="md", choices=["md", "json"])
    a = ap.parse_args()
    lvx, work, media, model = bench_paths(a.workdir)
    clip = media / "load_clip.mp4"
    if not clip.exists():
        subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                        "testsrc2=size=64x48:rate=4", "-t", "4", "-pix_fmt", "yuv420p", str(clip)],
                       check=True)
    want = json.loads(subprocess.run(
        [lvx, "qa", "--model", str(model), "--video", str(clip), "--question", QUESTION,
         "--num-frames", "4", "--max-new-tokens", "8", "--json", "--nproc", str(a.nproc)],
        check=True, capture_output=True, text=True).stdout)["response"]
    clip_url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    junk = base64.b64encode(os.urandom(int(a.mb * 1e6))).decode()
    body = json.dumps({"model": "model", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + junk}},
        {"type": "text", "text": QUESTION}]}]}).encode()
    rows = []
    for name, budget, clients in (("budget", int(a.budget_mb * 2**20), a.clients),
                                  ("no budget (1 TB)", 1 << 40, a.peer_clients)):
        srv = Server(lvx, str(model), str(media), a.nproc, budget)
        try:
            assert srv.ask(clip_url) == want, "answer differs from lvx qa"
            base = tree_rss(srv.proc.pid)
            r = run_load(srv, clients, a.slow, body)
            assert srv.ask(clip_url) == want, "answer after the load differs from lvx qa"
            assert srv.held() == 0, "request bytes still held after the load"
            r.update(name=name, budget_bytes=budget, clients=clients, body_bytes=len(body),
                     idle_rss_bytes=base)
            rows.append(r)
        finally:
            srv.stop()
    if a.output == "json":
        print(json.dumps(rows))
        return
    print("| server | clients x body | answered (status: count) | peak RSS GB | idle RSS GB | "
          "(peak - idle) / budget | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = ((r["peak_rss_bytes"] - r["idle_rss_bytes"]) / r["budget_bytes"]
                 if r["budget_bytes"] < (1 << 40) else float("nan"))
        print("| %s | %d x %.0f MB | %s | %.2f | %.2f | %.2f | %.1f |" % (
            r["name"], r["clients"], r["body_bytes"] / 1e6,
            ", ".join("%s: %d" % kv for kv in sorted(r["answers"].items())),
            r["peak_rss_bytes"] / 1e9, r["idle_rss_bytes"] / 1e9, ratio, r["wall_s"]))


if __name__ == "__main__":
    main()
