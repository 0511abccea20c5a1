"""lvx serve end to end: the shared harness of tests/serve (test_serve.py runs the cases).

The fixtures (a random mPLUG-Owl3 checkpoint and two test clips, made once per suite folder), the
reference answer (`lvx qa --json`), the server under test (`lvx serve` on a free port of
127.0.0.1, its stderr kept) and the request helpers every case module uses: chat messages with
video parts, file:// and data: URLs, raw HTTP and OpenAI's error shape.
"""
import base64
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent.parent
LVX = os.environ.get("LVX_BIN", str(SOURCE / "build" / "lvx"))
PY = sys.executable
KEY = "sk-test-key"
KEY2 = "sk-other-tenant"  # a second key of --api-key-file (uuid scoping)
QUESTION = "What colour was the shape?"
FRAMES = 8
TOKENS = 12


class Fixtures:
    def __init__(self, root: Path):
        self.root = root
        self.media = root / "media"
        self.media.mkdir(parents=True, exist_ok=True)
        self.model = root / "model"
        if not (self.model / "config.json").exists():
            subprocess.run([PY, str(SOURCE / "tests/reference/mplug_owl3_ref.py"), "make-model",
                            str(self.model), "--variant", "240728"], check=True,
                           stdout=subprocess.DEVNULL)
        self.clip = self.make_clip("clip.mp4", "testsrc=size=64x48:rate=4", 4)
        self.other = self.make_clip("other.mp4", "mandelbrot=size=64x48:rate=4", 4)

    def make_clip(self, name, source, seconds):
        path = self.media / name
        if not path.exists():
            subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i", source, "-t",
                            str(seconds), "-pix_fmt", "yuv420p", str(path)], check=True)
        return path


def qa_json(fx, video, ranks, extra=(), question=QUESTION):
    out = subprocess.run([LVX, "qa", "--model", str(fx.model), "--video", str(video), "--question",
                          question, "--num-frames", str(FRAMES), "--max-new-tokens", str(TOKENS),
                          "--json", "--nproc", str(ranks), *extra],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)


class Server:
    """`lvx serve` on a free port; its stderr kept for the checks."""

    def __init__(self, fx, ranks, *flags, env=None, key_flag=True):
        # key_flag: the key on the command line (--api-key); else in LVX_API_KEY (env).
        self.proc = subprocess.Popen(
            [LVX, "serve", "--model", str(fx.model), "--nproc", str(ranks), "--port", "0",
             *(["--api-key", KEY] if key_flag else []),
             "--allowed-local-media-path", str(fx.media), "--num-frames",
             str(FRAMES), "--max-new-tokens", str(TOKENS), *flags],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
            env={**os.environ, **(env or {})}, start_new_session=True)
        self.err = []
        deadline = time.time() + 60
        self.port = None
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.err.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        assert self.port, "server did not start:\n" + "".join(self.err)
        threading.Thread(target=self._drain, daemon=True).start()
        self.base = "http://127.0.0.1:%d" % self.port
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0,
                                    timeout=60)

    def _drain(self):
        for line in self.proc.stderr:
            self.err.append(line)

    def stderr(self):
        return "".join(self.err)

    def http(self, method, path, body=None, headers=None, key=KEY):
        """(status, body text) of a raw request."""
        h = {"Content-Type": "application/json"}
        if key:
            h["Authorization"] = "Bearer " + key
        h.update(headers or {})
        data = body if isinstance(body, (bytes, type(None))) else body.encode()
        req = urllib.request.Request(self.base + path, data=data, headers=h, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self):
        status, text = self.http("GET", "/metrics")
        assert status == 200, (status, text[:300])
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError("server did not stop within %d s after signal %d" % (timeout, sig))


def video_part(url):
    return {"type": "video_url", "video_url": {"url": url}}


def messages(*media, question=QUESTION):
    return [{"role": "user", "content": [*media, {"type": "text", "text": question}]}]


def ask(srv, *media, **kw):
    kw.setdefault("max_tokens", TOKENS)
    return srv.client.chat.completions.create(model="model", messages=messages(*media),
                                              temperature=0, **kw)


def file_url(path):
    return "file://" + str(path)


def data_url(path, kind):
    return "data:%s;base64,%s" % (kind, base64.b64encode(Path(path).read_bytes()).decode())


def expect_error(srv, status, body, key=KEY, path="/v1/chat/completions", headers=None):
    got, text = srv.http("POST", path, body, key=key, headers=headers)
    assert got == status, "expected %d, got %d: %s" % (status, got, text[:300])
    err = json.loads(text)["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err, text
    return err


def descendants(pid):
    """Every process under `pid` (its children, theirs, ...)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path("/proc/%d/task/%d/children" % (p, p)).read_text().split()
        except OSError:
            kids = []
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def raw_http(port, head, body=b"", timeout=5):
    """(status, body, closing) of one request written byte for byte; `closing`: the answer says
    `Connection: close`. Raises socket.timeout when no answer comes in `timeout` s."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sk:
        sk.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sk.recv(65536)
            if not chunk:
                break
            data += chunk
        header, _, rest = data.partition(b"\r\n\r\n")
        m = re.search(rb"Content-Length: *(\d+)", header, re.I)
        want = int(m.group(1)) if m else 0
        while len(rest) < want:
            chunk = sk.recv(65536)
            if not chunk:
                break
            rest += chunk
        closing = re.search(rb"\r\nConnection: *close", header, re.I) is not None
        return int(header.split()[1]), rest.decode(), closing
