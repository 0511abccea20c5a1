"""lvx serve end to end: a real server on 127.0.0.1 (a free port) at 1 or 2 ranks, spoken to with
the `openai` package (PyPI) and raw HTTP.

  python test_serve.py RANKS [-k SUBSTRING]    (LVX_BIN names the binary)

Each case is bounded (60 s) and asserts against an independent reference where there is one:
answers against `lvx qa --json` on the same video, frames and question (greedy, token for token:
the text and the token counts); image_url frames against lvx qa on the video they were cut from
(ffmpeg's PNGs of the frames lvx qa sampled); every error code by its status and OpenAI's error
shape; the visual cache by the hit counters of /metrics (every rank hits on a repeat, none after
the file changed); a killed rank by the 503 and the server's non-zero exit; SIGTERM by a stream
that still completes and an exit code of 0. Ends with the summary line "N passed, N failed".

Over 600 lines: one case per defect, all sharing one fixture set, the server harness and the CASES
table that the two CTest runs (1 and 2 ranks) walk; splitting the cases into modules by concern
(answers, errors and fuzz, security, batching) is left to issue 33, with the other large tests.
"""
import base64
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
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
        assert status == 200
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


# ---- cases ---------------------------------------------------------------------------------

def case_answers_equal_lvx_qa(fx, srv, ranks):
    want = qa_json(fx, fx.clip, ranks)
    r = ask(srv, video_part(file_url(fx.clip)))
    assert r.choices[0].message.content == want["response"], (r.choices[0].message.content, want)
    assert r.usage.prompt_tokens == want["prompt_tokens"]
    assert r.usage.completion_tokens == want["completion_tokens"]
    assert r.choices[0].finish_reason == want["finish_reason"]
    assert r.model == "model" and r.object == "chat.completion"
    # A base64 data URL of the same bytes: the same answer.
    r2 = ask(srv, video_part(data_url(fx.clip, "video/mp4")))
    assert r2.choices[0].message.content == want["response"]


def case_streaming(fx, srv, ranks):
    want = qa_json(fx, fx.clip, ranks)
    stream = ask(srv, video_part(file_url(fx.clip)), stream=True,
                 stream_options={"include_usage": True})
    text, finish, usage, chunks = "", None, None, 0
    for ch in stream:
        assert ch.object == "chat.completion.chunk"
        chunks += 1
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == want["response"], (text, want["response"])
    assert finish == want["finish_reason"]
    assert usage and usage.completion_tokens == want["completion_tokens"]
    assert chunks >= 3  # role, content pieces, finish
    # Raw SSE: events, then [DONE].
    body = json.dumps({"model": "model", "messages": messages(video_part(file_url(fx.clip))),
                       "stream": True, "max_tokens": 4})
    status, raw = srv.http("POST", "/v1/chat/completions", body)
    assert status == 200 and raw.rstrip().endswith("data: [DONE]"), raw[-200:]


def case_image_frames(fx, srv, ranks):
    # The frames lvx qa sampled, cut by ffmpeg's own decoder into PNGs, sent as image_url parts
    # (as lmms-eval does): the same answer as lvx qa on the video.
    want = qa_json(fx, fx.clip, ranks)
    d = Path(tempfile.mkdtemp(dir=fx.root))
    sel = "+".join("eq(n\\,%d)" % i for i in want["frame_indices"])
    subprocess.run(["ffmpeg", "-loglevel", "error", "-i", str(fx.clip), "-vf", "select=" + sel,
                    "-vsync", "0", str(d / "f%03d.png")], check=True)
    pngs = sorted(d.glob("f*.png"))
    assert len(pngs) == FRAMES, pngs
    parts = [{"type": "image_url", "image_url": {"url": data_url(p, "image/png")}} for p in pngs]
    before = srv.metrics()
    r = ask(srv, *parts)
    assert r.choices[0].message.content == want["response"], (r.choices[0].message.content, want)
    assert r.usage.prompt_tokens == want["prompt_tokens"]
    # The same frames again: every rank finds them encoded.
    r2 = ask(srv, *parts)
    assert r2.choices[0].message.content == want["response"]
    after = srv.metrics()
    assert after["lvx_visual_cache_hits_total"] - before["lvx_visual_cache_hits_total"] == ranks


def case_cache_hits_and_changed_file(fx, srv, ranks):
    path = fx.media / "changing.mp4"
    shutil.copy(fx.clip, path)
    m0 = srv.metrics()
    a = ask(srv, video_part(file_url(path)))
    m1 = srv.metrics()
    b = ask(srv, video_part(file_url(path)))
    m2 = srv.metrics()
    assert a.choices[0].message.content == b.choices[0].message.content
    hits = lambda m: m["lvx_visual_cache_hits_total"]
    misses = lambda m: m["lvx_visual_cache_misses_total"]
    assert hits(m2) - hits(m1) == ranks and misses(m2) == misses(m1), (m1, m2)
    # A hit decodes and encodes nothing: the slowest rank's encoding time is the lookup's.
    lvx = b.model_extra["lvx"]
    vc = lvx["visual_cache"]
    assert {k: vc[k] for k in ("hits", "misses")} == {"hits": ranks, "misses": 0}, vc
    # The prompt prefix (up to the last frame token) ran once: the repeat starts from its state.
    assert vc["prefix_reused"] is True and vc["prefix_tokens"] > 0, vc
    assert m2["lvx_prefix_reuses_total"] - m1["lvx_prefix_reuses_total"] == 1, (m1, m2)
    assert lvx["timings"]["encode_s"] < 0.01, lvx
    assert m2["lvx_visual_cache_bytes"] > 0
    # The file changes in place (same name): no rank may use the old features.
    shutil.copy(fx.other, path)
    c = ask(srv, video_part(file_url(path)))
    m3 = srv.metrics()
    assert misses(m3) - misses(m2) == ranks and hits(m3) == hits(m2), (m2, m3)
    assert c.choices[0].message.content == qa_json(fx, fx.other, ranks)["response"]
    # A caller's video_id names a video but never stands in for its bytes: another client's
    # upload under the same id gets its own video's answer, not the cached one.
    third = fx.make_clip("third.mp4", "rgbtestsrc=size=64x48:rate=4", 4)  # never asked about
    ask(srv, video_part(file_url(fx.clip)), extra_body={"video_id": "clip-1"})
    m4 = srv.metrics()
    spoof = ask(srv, video_part(data_url(third, "video/mp4")), extra_body={"video_id": "clip-1"})
    m5 = srv.metrics()
    assert misses(m5) - misses(m4) == ranks, (m4, m5)
    assert spoof.choices[0].message.content == qa_json(fx, third, ranks)["response"]
    # Another question about the same video reuses it too, and still answers as `lvx qa` does.
    q2 = "What is shown in the video?"
    d = srv.client.chat.completions.create(
        model="model", messages=messages(video_part(file_url(fx.clip)), question=q2),
        temperature=0, max_tokens=TOKENS)
    assert d.model_extra["lvx"]["visual_cache"]["prefix_reused"] is True
    assert d.choices[0].message.content == qa_json(fx, fx.clip, ranks, question=q2)["response"]


def tokenizer_ids(fx, text):
    """The tokenizers package's ids of a whole chat string (its special tokens as ids)."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(fx.model / "tokenizer.json")).encode(
        text, add_special_tokens=False).ids


def chatml(system, turns, question, frames):
    """mPLUG-Owl3's chat as text (the processor's build_text_qwen), the last question open."""
    text = "<|im_start|>system\n%s<|im_end|>" % system
    for i, (q, a) in enumerate(turns + [(question, None)]):
        text += "\n<|im_start|>user\n" + ("<|image|>" * frames + "\n" if i == 0 else "") + q
        text += "<|im_end|>\n<|im_start|>assistant\n" + ("" if a is None else a + "<|im_end|>")
    return text


def rgb_frames(d, count, size):
    """`count` PNG frames of `size` x `size` (the vision tower's size: preprocessing does not
    resample them) and their RGB bytes as ffmpeg reads them back."""
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                    "testsrc2=size=%dx%d:rate=4" % (size, size), "-frames:v", str(count),
                    str(d / "g%03d.png")], check=True)
    pngs = sorted(d.glob("g*.png"))
    raw = [subprocess.run(["ffmpeg", "-loglevel", "error", "-i", str(p), "-f", "rawvideo",
                           "-pix_fmt", "rgb24", "-"], check=True, capture_output=True).stdout
           for p in pngs]
    return pngs, raw


def forward_greedy(fx, ids, raw, size, tokens, ranks):
    """lvx forward --generate's greedy tokens on the same ids and frames."""
    return forward_generate(fx, ids, raw, size, tokens, ranks)[0]


def forward_generate(fx, ids, raw, size, tokens, ranks):
    """lvx forward --generate on the same ids and frames (SigLIP's (x / 255 - 0.5) / 0.5): its
    greedy tokens and each step's logits [T, V]."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file
    d = Path(tempfile.mkdtemp(dir=fx.root))
    pix = np.stack([np.frombuffer(b, np.uint8).reshape(size, size, 3) for b in raw])
    pix = torch.from_numpy(pix.copy()).permute(0, 3, 1, 2).contiguous().float()
    pix = (pix / 255.0 - 0.5) / 0.5
    save_file({"input_ids": torch.tensor([ids], dtype=torch.int64), "pixel_values": pix},
              str(d / "in.safetensors"))
    subprocess.run([LVX, "forward", "--model", str(fx.model), "--input", str(d / "in.safetensors"),
                    "--output", str(d / "out.safetensors"), "--generate", str(tokens),
                    "--nproc", str(ranks)], check=True, capture_output=True, timeout=60)
    out = load_file(str(d / "out.safetensors"))
    return out["tokens"][0].tolist(), out["step_logits"][0]


def case_conversation_template(fx, srv, ranks):
    # A one-turn conversation is lvx qa's prompt; earlier turns and a system message are the
    # chat template's own turns (the tokenizers package encodes the chat text written out), and
    # the answer is the model's greedy answer to those tokens (lvx forward --generate).
    def ask_ids(msgs, **kw):
        status, text = srv.http("POST", "/v1/chat/completions", json.dumps(
            {"model": "model", "messages": msgs, "max_tokens": TOKENS, "return_prompt_ids": True,
             **kw}))
        assert status == 200, text
        return json.loads(text)

    clip = video_part(file_url(fx.clip))
    one = ask_ids(messages(clip))
    want = qa_json(fx, fx.clip, ranks)
    assert one["lvx"]["prompt_ids"] == tokenizer_ids(fx, chatml("", [], QUESTION, FRAMES))
    assert one["usage"]["prompt_tokens"] == want["prompt_tokens"] == len(one["lvx"]["prompt_ids"])
    assert one["choices"][0]["message"]["content"] == want["response"]

    size = 32  # the tiny SigLIP's image_size
    pngs, raw = rgb_frames(Path(tempfile.mkdtemp(dir=fx.root)), 4, size)
    frames = [{"type": "image_url", "image_url": {"url": data_url(p, "image/png")}} for p in pngs]
    convo = [{"role": "system", "content": "the shape"},
             {"role": "user", "content": [*frames, {"type": "text", "text": QUESTION}]},
             {"role": "assistant", "content": "red"},
             {"role": "user", "content": "and now?"}]
    two = ask_ids(convo)
    ids = two["lvx"]["prompt_ids"]
    assert ids == tokenizer_ids(fx, chatml("the shape", [(QUESTION, "red")], "and now?", 4))
    assert two["usage"]["prompt_tokens"] == len(ids)
    # The model's greedy tokens for the same prompt and frames, cut at the stop token.
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(fx.model / "tokenizer.json"))
    stops = {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    gen = forward_greedy(fx, ids, raw, size, TOKENS, ranks)
    print("  2 turns: %d prompt tokens, greedy %s" % (len(ids), gen))
    cut = next((i for i, t in enumerate(gen) if t in stops), len(gen))
    assert two["usage"]["completion_tokens"] == cut, (two["usage"], gen)
    assert two["choices"][0]["message"]["content"] == tok.decode(gen[:cut]), (two, gen)
    # Split user messages (frames in one, the text in the next) are one turn.
    split = [{"role": "user", "content": frames}, {"role": "user", "content": QUESTION}]
    assert ask_ids(split)["lvx"]["prompt_ids"] == tokenizer_ids(fx, chatml("", [], QUESTION, 4))
    # What the template cannot take is a 400 naming the message.
    late = convo + [{"role": "assistant", "content": "x"}, {"role": "system", "content": "late"},
                    {"role": "user", "content": "?"}]
    assert expect_error(srv, 400, json.dumps({"model": "model", "messages": late}))[
        "param"] == "messages[5].role"
    first = [{"role": "assistant", "content": "hi"}] + messages(clip)
    assert expect_error(srv, 400, json.dumps({"model": "model", "messages": first}))[
        "param"] == "messages[0].role"
    blank = [convo[1], convo[2], {"role": "user", "content": " "}]
    expect_error(srv, 400, json.dumps({"model": "model", "messages": blank}))


def case_error_codes(fx, srv, ranks):
    ok = json.dumps({"model": "model", "messages": messages(video_part(file_url(fx.clip)))})
    expect_error(srv, 400, "{not json")
    expect_error(srv, 400, json.dumps({"model": "model", "messages": "hi"}))
    expect_error(srv, 400, json.dumps({"model": "model", "messages": messages()}))  # no video
    expect_error(srv, 400, json.dumps({"model": "model", "temperature": -1,
                                       "messages": messages(video_part(file_url(fx.clip)))}))
    expect_error(srv, 400, json.dumps({"model": "model", "messages": messages(
        video_part(file_url(fx.media / "missing.mp4")))}))  # no such file
    expect_error(srv, 400, json.dumps({"model": "model", "messages": messages(
        video_part("data:video/mp4;base64,!!!"))}))
    err = expect_error(srv, 404, json.dumps({"model": "gpt-4o", "messages": messages(
        video_part(file_url(fx.clip)))}))
    assert err["code"] == "model_not_found"
    expect_error(srv, 401, ok, key=None)
    expect_error(srv, 401, ok, key="sk-wrong")
    assert srv.http("GET", "/v1/models", key=None)[0] == 401
    expect_error(srv, 403, json.dumps({"model": "model", "messages": messages(
        video_part("file:///etc/hostname"))}))
    link = fx.media / "escape.mp4"
    if not link.exists():
        os.symlink("/etc/hostname", link)
    expect_error(srv, 403, json.dumps({"model": "model", "messages": messages(
        video_part(file_url(link)))}))
    expect_error(srv, 403, json.dumps({"model": "model", "messages": messages(
        video_part("file://" + str(fx.media) + "/../model/config.json"))}))
    big = json.dumps({"model": "model", "pad": "x" * (300 << 10),
                      "messages": messages(video_part(file_url(fx.clip)))})
    expect_error(srv, 413, big)
    # The openai client sees the same statuses as its exceptions.
    try:
        srv.client.chat.completions.create(model="nope", messages=messages(
            video_part(file_url(fx.clip))))
        raise AssertionError("no error for an unknown model")
    except openai.NotFoundError:
        pass
    # Nothing else disturbed: a good request still works, and /v1/models, /health answer.
    assert ask(srv, video_part(file_url(fx.clip))).choices[0].message.content is not None
    status, models = srv.http("GET", "/v1/models")
    assert status == 200 and json.loads(models)["data"][0]["id"] == "model"
    assert srv.http("GET", "/health", key=None)[0] == 200


def case_queue_full_429(fx, srv, ranks):
    # --max-queue 1: of many requests sent at once, some wait, one runs, the rest get 429.
    body = json.dumps({"model": "model", "max_tokens": 60,
                       "messages": messages(video_part(file_url(fx.clip)))})
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        t0 = time.time()
        codes = list(ex.map(lambda _: srv.http("POST", "/v1/chat/completions", body)[0],
                            range(8)))
    print("  8 requests at once: %s in %.1f s" % (codes, time.time() - t0))
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    status, text = srv.http("POST", "/v1/chat/completions", body)
    assert status == 200, text
    m = srv.metrics()
    assert m['lvx_requests_total{status="429"}'] == codes.count(429)


def case_stop_and_disconnect(fx, srv, ranks):
    full = ask(srv, video_part(file_url(fx.clip)), max_tokens=40).choices[0].message.content
    if len(full) > 6:
        stop = full[3:5]
        r = ask(srv, video_part(file_url(fx.clip)), max_tokens=40, stop=[stop])
        assert r.choices[0].message.content == full[:full.index(stop)], (full, stop, r)
        assert r.choices[0].finish_reason == "stop"
    # A client that goes away mid-stream stops its generation.
    before = srv.metrics()["lvx_generated_tokens_total"]
    stream = srv.client.chat.completions.create(
        model="model", messages=messages(video_part(file_url(fx.clip))), temperature=0,
        max_tokens=400, stream=True)
    for _ in stream:
        break
    stream.close()
    time.sleep(1.0)
    ask(srv, video_part(file_url(fx.clip)), max_tokens=1)  # runs after the cancelled one
    used = srv.metrics()["lvx_generated_tokens_total"] - before
    assert used < 400, used


def case_nonstreaming_client_leaves(fx, srv, ranks):
    # A non-streaming client that closes its socket while its answer runs (20,000 tokens: far
    # longer than the case may take) or waits in the queue: its generation stops, the cancelled
    # counter says so, and the next request is answered at once.
    import socket

    def leave(max_tokens, wait_s):
        body = json.dumps({"model": "model", "max_tokens": max_tokens,
                           "messages": messages(video_part(file_url(fx.clip)))}).encode()
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                  KEY.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: " +
                  str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(wait_s)
        s.close()

    def counter(name):
        return srv.metrics().get(name, 0)

    ask(srv, video_part(file_url(fx.clip)), max_tokens=1)  # the video cached: a quick prefill
    m0 = srv.metrics()
    leave(20000, 1.0)  # running when it leaves
    deadline = time.time() + 10
    while counter("lvx_requests_cancelled_total") < m0["lvx_requests_cancelled_total"] + 1:
        assert time.time() < deadline, "the departed client's request was not cancelled"
        time.sleep(0.05)
    t0 = time.time()
    r = ask(srv, video_part(file_url(fx.clip)), max_tokens=4)
    took = time.time() - t0
    m1 = srv.metrics()
    used = m1["lvx_generated_tokens_total"] - m0["lvx_generated_tokens_total"]
    print("  cancelled after %d tokens; the next request took %.2f s" % (used - 4, took))
    assert r.choices[0].message.content is not None and took < 10, took
    assert used < 20000, used
    # One that leaves while another runs (a stream held open until then, not identical: it does
    # not join it): it never runs.
    blocker = srv.client.chat.completions.create(
        model="model", messages=messages(video_part(file_url(fx.clip))), temperature=0,
        max_tokens=19999, stream=True)
    next(iter(blocker))  # running
    leave(20000, 0.3)
    time.sleep(0.5)  # its departure seen while it waits (every 100 ms)
    blocker.close()
    deadline = time.time() + 10
    while counter("lvx_requests_cancelled_total") < m1["lvx_requests_cancelled_total"] + 2:
        assert time.time() < deadline, "the request that left the queue was not cancelled"
        time.sleep(0.05)
    # Only the blocker's prompt was run.
    assert srv.metrics()["lvx_prompt_tokens_total"] - m1["lvx_prompt_tokens_total"] == \
        r.usage.prompt_tokens
    assert ask(srv, video_part(file_url(fx.clip)), max_tokens=1).choices[0].message.content \
        is not None


def case_identical_requests_share_generation(fx, srv, ranks):
    # Requests queued behind a long one: the identical ones (media, question, sampling,
    # max_tokens) are answered by one generation, each exactly as alone (lvx qa's answer), each
    # with its own stop strings; a different question is not merged.
    want = qa_json(fx, fx.clip, ranks)
    clip = video_part(file_url(fx.clip))
    other_q = "What shape was the colour?"
    alone_other = srv.client.chat.completions.create(
        model="model", messages=messages(clip, question=other_q), temperature=0,
        max_tokens=TOKENS).choices[0].message.content
    full = want["response"]
    stop = full[2:4] if len(full) > 5 else None
    m0 = srv.metrics()

    def post(question=QUESTION, **kw):
        status, text = srv.http("POST", "/v1/chat/completions", json.dumps(
            {"model": "model", "max_tokens": TOKENS, "messages": messages(clip, question=question),
             **kw}))
        assert status == 200, text
        return json.loads(text)

    # A stream held open keeps the generation busy until all of them wait in the queue.
    blocker = srv.client.chat.completions.create(
        model="model", messages=messages(clip), temperature=0, max_tokens=20000, stream=True)
    next(iter(blocker))
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        same = [ex.submit(post) for _ in range(4)]
        cut = ex.submit(post, stop=[stop]) if stop else None
        different = ex.submit(post, question=other_q)
        queued = 5 + (cut is not None)
        deadline = time.time() + 20
        while srv.metrics()["lvx_queue_depth"] < queued:
            assert time.time() < deadline, "the requests did not queue"
            time.sleep(0.05)
        blocker.close()
        for f in same:
            r = f.result()
            assert r["choices"][0]["message"]["content"] == full, (r, want)
            assert r["usage"]["completion_tokens"] == want["completion_tokens"]
            assert r["usage"]["prompt_tokens"] == want["prompt_tokens"]
        if cut:
            assert cut.result()["choices"][0]["message"]["content"] == full[:full.index(stop)]
        assert different.result()["choices"][0]["message"]["content"] == alone_other
    merged = srv.metrics()["lvx_requests_merged_total"] - m0["lvx_requests_merged_total"]
    print("  %d of %d identical requests answered by another's generation" % (
        merged, 4 + (cut is not None)))
    assert merged == 3 + (cut is not None), merged
    # One that arrives while an identical generation runs joins it: the text so far at once, then
    # the rest, cut by its own stop string. The first client leaves once it joined; the joiner's
    # stop string then ends the generation (2,000 tokens asked).
    assert stop, "the answer is too short for a stop string: %r" % full
    m1 = srv.metrics()
    leader = srv.client.chat.completions.create(
        model="model", messages=messages(clip), temperature=0, max_tokens=2000, stream=True)
    next(iter(leader))
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        joiner = ex.submit(post, max_tokens=2000, stop=[stop])
        deadline = time.time() + 20
        while srv.metrics()["lvx_requests_running"] < 2:
            assert time.time() < deadline, "the identical request did not join"
            time.sleep(0.02)
        leader.close()
        j = joiner.result()
    assert j["choices"][0]["message"]["content"] == full[:full.index(stop)], (j, full)
    assert j["choices"][0]["finish_reason"] == "stop"
    assert srv.metrics()["lvx_requests_merged_total"] - m1["lvx_requests_merged_total"] == 1


def case_distinct_questions_batched(fx, srv, ranks):
    # Continuous batching: distinct questions about one video sent at once run together (one
    # decode step for all, rows joining as their prefill ends and leaving at their own end);
    # each answer is lvx qa's for its question, token for token.
    clip = video_part(file_url(fx.clip))
    questions = [QUESTION, "What shape was the colour?", "Where did the shape move?",
                 "How many shapes were there?"]
    want = [qa_json(fx, fx.clip, ranks, question=q) for q in questions]
    ask(srv, clip, max_tokens=1)  # the video cached: the prefills are quick, the rows overlap
    m0 = srv.metrics()
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as ex:
        got = list(ex.map(lambda q: srv.client.chat.completions.create(
            model="model", messages=messages(clip, question=q), temperature=0,
            max_tokens=TOKENS), questions))
    for q, w, r in zip(questions, want, got):
        assert r.choices[0].message.content == w["response"], (q, r.choices[0].message.content, w)
        assert r.usage.completion_tokens == w["completion_tokens"], q
    m1 = srv.metrics()
    steps = m1["lvx_decode_steps_total"] - m0["lvx_decode_steps_total"]
    rows = m1["lvx_decode_step_rows_total"] - m0["lvx_decode_step_rows_total"]
    print("  %d questions: %d decode steps, %.2f generations per step, at most %d" % (
        len(questions), steps, rows / max(steps, 1), m1["lvx_decode_batch_max"]))
    assert m1["lvx_decode_batch_max"] >= 2, m1["lvx_decode_batch_max"]
    assert rows > steps, (rows, steps)


def case_chunked_prefill(fx, srv, ranks):
    # --max-batch-tokens 4: a cache miss's prompt prefix runs in chunks of 4 tokens (its frames
    # decoded and encoded on a worker thread of each rank), one chunk between two decode steps,
    # while questions about a cached video run. Every answer equals lvx qa's with the same chunks
    # token for token (the same chunk size gives the same bits), the miss's also lvx qa's whole
    # prefill's, and /metrics counts the miss's chunks: ceil(prefix tokens / 4).
    chunks = ("--max-batch-tokens", "4")
    clip, other = video_part(file_url(fx.clip)), video_part(file_url(fx.other))
    questions = ["What shape was the colour?", "Where did the shape move?"]
    want = [qa_json(fx, fx.clip, ranks, chunks, question=q) for q in questions]
    want_miss = qa_json(fx, fx.other, ranks, chunks)
    assert want_miss["response"] == qa_json(fx, fx.other, ranks)["response"]
    ask(srv, clip, max_tokens=1)  # cached (its prefix in chunks too)
    m0 = srv.metrics()
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        miss = ex.submit(ask, srv, other, max_tokens=TOKENS)
        got = list(ex.map(lambda q: srv.client.chat.completions.create(
            model="model", messages=messages(clip, question=q), temperature=0,
            max_tokens=TOKENS), questions))
        miss = miss.result()
    for q, w, r in zip(questions, want, got):
        assert r.choices[0].message.content == w["response"], (q, r.choices[0].message.content, w)
    assert miss.choices[0].message.content == want_miss["response"], (miss, want_miss)
    prefix = miss.model_extra["lvx"]["visual_cache"]["prefix_tokens"]
    m1 = srv.metrics()
    ran = m1["lvx_prefill_chunks_total"] - m0["lvx_prefill_chunks_total"]
    print("  the miss's prefix of %d tokens in %d chunks; %d decode steps ran between chunks" % (
        prefix, ran, m1["lvx_decode_steps_during_prefill_total"]))
    assert prefix > 8 and ran == -(-prefix // 4), (prefix, ran)


def case_sigterm_finishes_in_flight(fx, srv, ranks):
    # The stream in flight completes; a request arriving during the drain gets 503 (it got 200
    # while the generation loop had not yet looked at the signal). The drain is seen to have
    # begun on /health (the launcher forwards the signal within 50 ms).
    got = {}
    first = threading.Event()

    def run():
        s = ask(srv, video_part(file_url(fx.clip)), max_tokens=300, stream=True)
        parts = []
        for c in s:
            first.set()
            parts.append(c.choices[0].delta.content or "" if c.choices else "")
        got["text"] = "".join(parts)
        got["done_at"] = time.time()

    t = threading.Thread(target=run)
    t.start()
    assert first.wait(30), "the stream sent nothing"
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 5
    while srv.http("GET", "/health", key=None)[0] != 503 and time.time() < deadline:
        time.sleep(0.01)
    status, text = srv.http("POST", "/v1/chat/completions",
                            json.dumps({"model": "model", "max_tokens": 4,
                                        "messages": messages(video_part(file_url(fx.clip)))}))
    answered_at = time.time()
    code = srv.stop(signal.SIGTERM)
    t.join(30)
    assert got.get("done_at"), "the stream in flight did not complete"
    print("  drain probe: %d, stream ended %.2f s after it" % (status, got["done_at"] - answered_at))
    assert got["done_at"] > answered_at, "the stream ended before the probe: make it longer"
    assert status == 503 and "shutting down" in text, (status, text[:300])
    assert code == 0, "exit %s\n%s" % (code, srv.stderr())


def case_killed_rank_503(fx, srv, ranks):
    # Rank 1 (a child of the launcher with RANK=1) dies: requests get 503 and the server exits
    # non-zero within LVX_DIST_TIMEOUT_S (4 s here) plus its heartbeat.
    kids = subprocess.run(["pgrep", "-P", str(srv.proc.pid)], capture_output=True,
                          text=True).stdout.split()
    victim = None
    for pid in kids:
        env = Path("/proc/%s/environ" % pid).read_bytes().split(b"\0")
        if b"RANK=1" in env:
            victim = int(pid)
    assert victim, kids
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    status, text = srv.http("POST", "/v1/chat/completions", json.dumps(
        {"model": "model", "messages": messages(video_part(file_url(fx.clip)))}))
    assert status == 503, (status, text)
    assert json.loads(text)["error"]["type"] == "server_error"
    code = srv.proc.wait(timeout=30)
    assert code != 0, srv.stderr()
    assert time.time() - t0 < 20, time.time() - t0


def case_port_in_use_fails_every_rank_at_once(fx, srv, ranks):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    t0 = time.time()
    r = subprocess.run([LVX, "serve", "--model", str(fx.model), "--nproc", str(ranks), "--port",
                        str(s.getsockname()[1])], capture_output=True, text=True, timeout=60)
    s.close()
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert re.search(r"cannot listen on 127\.0\.0\.1:\d+ \(--host, --port\)", r.stderr), r.stderr
    assert time.time() - t0 < 30, "took %.1f s: the other ranks waited" % (time.time() - t0)


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


def case_hostile_bodies(fx, srv, ranks):
    # Bodies a fuzzer sends: each gets a 400 with an error object that quotes nothing of the
    # body and names no parser internals, and the server lives on.
    good = messages(video_part(file_url(fx.clip)))
    deep = "[" * 100000 + "]" * 100000
    for field in ("max_tokens", "n", "seed", "num_frames"):
        body = '{"model": "model", "%s": %s, "messages": %s}' % (field, deep, json.dumps(good))
        err = expect_error(srv, 400, body)
        assert "deeper than 64" in err["message"], err
    err = expect_error(srv, 400, "{not json")
    assert "json.exception" not in err["message"] and "not valid JSON" in err["message"], err
    bad_utf8 = b'{"model": "\xff\xfemodel", "messages": []}'
    got, text = srv.http("POST", "/v1/chat/completions", bad_utf8)
    assert got == 400, (got, text)
    json.loads(text)
    err = expect_error(srv, 400, json.dumps({"model": "model", "max_tokens": "x" * 5000,
                                             "messages": good}))
    assert "x" * 100 not in err["message"] and "a string" in err["message"], err
    for field, value in (("logprobs", "yes"), ("logit_bias", {"5": 1}), ("tools", []),
                         ("response_format", {"type": "json_object"}), ("frequency_penalty", 1)):
        err = expect_error(srv, 400, json.dumps({"model": "model", field: value, "messages": good}))
        assert err["param"] == field and field in err["message"], err
    # A small PNG declaring 16000 x 16000 pixels is refused from its header, not decoded.
    t0 = time.time()
    png = "data:image/png;base64," + base64.b64encode(huge_png(16000, 16000)).decode()
    err = expect_error(srv, 400, json.dumps({"model": "model", "messages": [{"role": "user",
        "content": [{"type": "image_url", "image_url": {"url": png}},
                    {"type": "text", "text": QUESTION}]}]}))
    assert "exceed the limit" in err["message"] and time.time() - t0 < 5, err
    # A data URL whose base64 goes wrong after 3 MB of good text (decoded straight into its
    # file, so the fault is found while writing): 400 naming the part.
    bad = "data:video/mp4;base64," + base64.b64encode(b"\0" * (3 << 20)).decode() + "*AAA"
    err = expect_error(srv, 400, json.dumps({"model": "model", "messages": [{"role": "user",
        "content": [{"type": "video_url", "video_url": {"url": bad}},
                    {"type": "text", "text": QUESTION}]}]}))
    assert "video_url: the data URL's base64 is malformed" in err["message"], err
    assert srv.http("GET", "/health", key=None)[0] == 200
    assert ask(srv, video_part(file_url(fx.clip))).choices[0].message.content is not None


def huge_png(w, h):
    """A grey PNG of w x h zero pixels: a few hundred KB that decode to w·h bytes."""
    import struct
    import zlib
    z = zlib.compressobj(9)
    row = b"\0" * (w + 1)
    data = b"".join(z.compress(row) for _ in range(h)) + z.flush()

    def chunk(kind, body):
        return (struct.pack(">I", len(body)) + kind + body +
                struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) +
            chunk(b"IDAT", data) + chunk(b"IEND", b""))


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


def case_hostile_framing(fx, srv, ranks):
    # Malformed framing is answered from the headers at once (each of these held an HTTP thread
    # until the 300 s read timeout, or was accepted), with `Connection: close` (cpp-httplib
    # itself keeps the socket for its 5 s keep-alive unless the client closes it).
    start = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n" % KEY
    cases = [
        ("Content-Length: 5\r\nContent-Length: 5\r\n", 400, "more than one Content-Length"),
        ("Content-Length: -1\r\n", 400, "not a byte count"),
        ("Content-Length: 18446744073709551616\r\n", 400, "not a byte count"),
        ("Content-Length: %d\r\n" % (1 << 40), 413, "larger than the server's limit"),
        ("Transfer-Encoding: gzip, chunked\r\n", 400, "Transfer-Encoding"),
        ("Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", 400, "both"),
        ("", 411, "Content-Length"),
    ]
    for headers, want, words in cases:
        t0 = time.time()
        status, text, closing = raw_http(srv.port, start + headers)
        assert status == want and words in json.loads(text)["error"]["message"], (headers, text)
        assert time.time() - t0 < 2 and closing, (headers, time.time() - t0, closing)
    assert srv.http("GET", "/health", key=None)[0] == 200
    assert ask(srv, video_part(file_url(fx.clip))).choices[0].message.content is not None


def case_frame_settings_per_request(fx, srv, ranks):
    # vLLM's media_io_kwargs (lmms-eval's pass_video_url=True) sets the frames of one request.
    want = qa_json(fx, fx.clip, ranks, extra=("--num-frames", "4"))
    for extra in ({"media_io_kwargs": {"video": {"num_frames": 4}}},
                  {"mm_processor_kwargs": {"num_frames": 4}}, {"num_frames": 4}):
        r = ask(srv, video_part(file_url(fx.clip)), extra_body=extra)
        assert r.usage.prompt_tokens == want["prompt_tokens"], (extra, r.usage, want)
        assert r.choices[0].message.content == want["response"]
    expect_error(srv, 400, json.dumps({"model": "model", "num_frames": 4,
                                       "media_io_kwargs": {"video": {"num_frames": 4}},
                                       "messages": messages(video_part(file_url(fx.clip)))}))
    err = expect_error(srv, 400, json.dumps({"model": "model",
                                             "media_io_kwargs": {"video": {"width": 4}},
                                             "messages": messages(video_part(file_url(fx.clip)))}))
    assert "width" in err["message"], err


def case_uploads_stay_private(fx, srv, ranks):
    # Uploads go into private folders of unpredictable names: a link planted where the server
    # used to write (/tmp/lvx-serve-<pid>-<n>) catches nothing, no upload folder stays behind,
    # uploads leave no frame index in the index cache, and a playlist cannot reach other files.
    victim = Path(tempfile.mkdtemp(dir=fx.root))
    tmp = Path(tempfile.gettempdir())
    # Every rank makes its folders in the run's own temporary folder (so the check below sees
    # this server's, never another suite's).
    for pid in descendants(srv.proc.pid) + [srv.proc.pid]:
        env = Path("/proc/%s/environ" % pid).read_bytes().split(b"\0")
        assert ("TMPDIR=%s" % tmp).encode() in env, (pid, tmp)
    planted = []
    for pid in descendants(srv.proc.pid) + [srv.proc.pid]:
        for n in range(3):
            link = tmp / ("lvx-serve-%d-%d" % (pid, n))
            if not os.path.lexists(link):
                os.symlink(victim, link)
                planted.append(link)
    index = Path(os.environ["LVX_TEST_INDEX_DIR"])
    before_index = sorted(index.rglob("*"))
    before_dirs = set(tmp.glob("lvx-serve-*"))
    try:
        r = ask(srv, video_part(data_url(fx.clip, "video/mp4")))
        assert r.choices[0].message.content == qa_json(fx, fx.clip, ranks)["response"]
        assert list(victim.iterdir()) == [], list(victim.iterdir())
        # Rank 0's folder goes with the request, just after its answer is sent.
        deadline = time.time() + 5
        while set(tmp.glob("lvx-serve-*")) - before_dirs and time.time() < deadline:
            time.sleep(0.05)
        left = set(tmp.glob("lvx-serve-*")) - before_dirs
        assert not left, left
        assert sorted(index.rglob("*")) == before_index, "an upload left a frame index"
        # An HLS playlist naming a file on the server is refused, not followed.
        playlist = fx.root / "list.m3u8"
        playlist.write_text("#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:4\n#EXTINF:4.0,\n"
                            "file://%s\n#EXT-X-ENDLIST\n" % fx.clip)
        err = expect_error(srv, 400, json.dumps({"model": "model", "messages": messages(
            video_part(data_url(playlist, "video/mp4")))}))
        # Error texts name the client's media, never our source files or temporary paths.
        assert ".cpp" not in err["message"] and "lvx-serve-" not in err["message"], err
        assert "the uploaded video" in err["message"], err
    finally:
        for link in planted:
            link.unlink()


def case_api_key_stays_secret(fx, srv, ranks):
    # The key comes by environment: no rank's command line holds it; /metrics needs it.
    for pid in descendants(srv.proc.pid) + [srv.proc.pid]:
        try:
            cmdline = Path("/proc/%d/cmdline" % pid).read_bytes()
        except OSError:
            continue
        assert KEY.encode() not in cmdline, (pid, cmdline)
    assert srv.http("GET", "/metrics", key=None)[0] == 401
    assert srv.http("GET", "/metrics")[0] == 200
    expect_error(srv, 401, json.dumps({"model": "model", "messages": []}), key=KEY + "x")
    assert ask(srv, video_part(file_url(fx.clip))).choices[0].message.content is not None


def case_api_key_flag_not_in_rank_argv(fx, srv, ranks):
    # --api-key given: the ranks still get the key by environment, never in their argv.
    for pid in descendants(srv.proc.pid):
        try:
            cmdline = Path("/proc/%d/cmdline" % pid).read_bytes()
        except OSError:
            continue
        assert KEY.encode() not in cmdline, (pid, cmdline)
    assert "visible to every local user" in srv.stderr()
    assert srv.http("GET", "/metrics", key=None)[0] == 200  # --metrics-public
    assert ask(srv, video_part(file_url(fx.clip))).choices[0].message.content is not None


def case_logprobs(fx, srv, ranks):
    # logprobs / top_logprobs: each completion token's log-probability and the 5 most likely
    # tokens' equal (1e-4) log_softmax of lvx forward's step logits on the same prompt ids and
    # frames (a path without the server, the prompt's split or the visual cache); streamed, the
    # chunks carry the same entries, in order.
    import torch
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(fx.model / "tokenizer.json"))
    size = 32  # the tiny SigLIP's image_size: no resampling
    pngs, raw = rgb_frames(Path(tempfile.mkdtemp(dir=fx.root)), 4, size)
    frames = [{"type": "image_url", "image_url": {"url": data_url(p, "image/png")}} for p in pngs]
    msgs = [{"role": "user", "content": [*frames, {"type": "text", "text": QUESTION}]}]
    body = {"model": "model", "messages": msgs, "max_tokens": TOKENS, "logprobs": True,
            "top_logprobs": 5}
    status, text = srv.http("POST", "/v1/chat/completions",
                            json.dumps(body | {"return_prompt_ids": True}))
    assert status == 200, text
    r = json.loads(text)
    entries = r["choices"][0]["logprobs"]["content"]
    assert len(entries) == r["usage"]["completion_tokens"] > 0, r
    tokens, logits = forward_generate(fx, r["lvx"]["prompt_ids"], raw, size, TOKENS, ranks)
    lp = torch.log_softmax(logits.double(), -1)
    for t, e in enumerate(entries):
        top = torch.topk(lp[t], 5)
        assert abs(e["logprob"] - lp[t][tokens[t]].item()) < 1e-4, (t, e)
        got = [x["logprob"] for x in e["top_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, top.values.tolist())) < 1e-4, (t, e, top)
        want = [tok.decode([i], skip_special_tokens=False) for i in top.indices.tolist()]
        for x, w in zip(e["top_logprobs"], want):
            assert x["token"] == w, (x, w)  # the text of the token alone, as tokenizers gives it
            if "\ufffd" not in w:  # else a token holding part of a character: its own bytes
                assert x["bytes"] == list(w.encode()), (x, w)
            assert bytes(x["bytes"]).decode("utf-8", "replace") == w, (x, w)
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the most likely
    assert r["choices"][0]["message"]["content"] == tok.decode(tokens[:len(entries)])
    streamed = []
    for chunk in srv.client.chat.completions.create(model="model", messages=msgs, stream=True,
                                                    max_tokens=TOKENS, temperature=0,
                                                    logprobs=True, top_logprobs=5):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += [c.model_dump() for c in chunk.choices[0].logprobs.content]
    assert [(e["token"], round(e["logprob"], 5)) for e in streamed] == \
        [(e["token"], round(e["logprob"], 5)) for e in entries]
    # Without logprobs the choice's logprobs are null; top_logprobs needs logprobs, at most 20.
    assert json.loads(srv.http("POST", "/v1/chat/completions", json.dumps(
        {"model": "model", "messages": msgs, "max_tokens": 2}))[1])["choices"][0]["logprobs"] is None
    assert expect_error(srv, 400, json.dumps(body | {"logprobs": False}))["param"] == "top_logprobs"
    assert expect_error(srv, 400, json.dumps(body | {"top_logprobs": 21}))["param"] == "top_logprobs"


def case_inflight_budget(fx, srv, ranks):
    # --max-inflight-bytes 3 MB: a body is reserved from its headers, before it is read, until its
    # answer is sent. Two slow clients declaring 1.2 MB each and sending a little hold 2.4 MB; a
    # third is refused at once (429, Retry-After) unread, a body larger than the whole budget 413;
    # once the slow clients leave, their bytes come back and requests are answered again.
    import socket
    start = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n" % KEY
    held = lambda: srv.metrics()["lvx_inflight_bytes"]
    assert srv.metrics()["lvx_inflight_limit_bytes"] == 3 << 20
    slow = []
    for _ in range(2):
        sk = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        sk.sendall((start + "Content-Length: 1200000\r\n\r\n{\"model\"").encode())
        slow.append(sk)
    deadline = time.time() + 5
    while held() != 2400000 and time.time() < deadline:
        time.sleep(0.05)
    assert held() == 2400000, srv.metrics()
    t0 = time.time()
    status, text, closing = raw_http(srv.port, start + "Content-Length: 1200000\r\n")
    err = json.loads(text)["error"]
    assert status == 429 and err["code"] == "inflight_full" and closing, (status, text)
    assert "--max-inflight-bytes" in err["message"] and time.time() - t0 < 2, err
    status, text, _ = raw_http(srv.port, start + "Content-Length: %d\r\n" % (4 << 20))
    assert status == 413 and "--max-inflight-bytes" in json.loads(text)["error"]["message"], text
    for sk in slow:
        sk.close()
    deadline = time.time() + 5
    while held() != 0 and time.time() < deadline:
        time.sleep(0.05)
    assert held() == 0, srv.metrics()  # the slow clients' bytes came back
    assert ask(srv, video_part(data_url(fx.clip, "video/mp4"))).choices[0].message.content == \
        qa_json(fx, fx.clip, ranks)["response"]
    assert held() == 0, srv.metrics()  # and an answered request's too


def case_fuzz(fx, srv, ranks):
    # A bounded fuzz of hostile requests by class (seeded; about 400 requests): every answer is a
    # status the class allows with, when not 200, OpenAI's error object naming no source file or
    # temporary path; after each class the server is alive (/health) and answers a good request.
    import random
    import socket
    rng = random.Random(31)
    good = messages(video_part(file_url(fx.clip)))
    base = {"model": "model", "messages": good, "max_tokens": 2}

    def check(status, text, allowed, what):
        assert status in allowed, (what, status, text[:300])
        if status != 200:
            err = json.loads(text)["error"]
            assert isinstance(err["message"], str) and err["message"] and "type" in err, text
            assert ".cpp" not in text and "lvx-serve-" not in text, (what, text[:300])

    def alive(cls):
        assert srv.http("GET", "/health", key=None)[0] == 200, cls
        status, text = srv.http("POST", "/v1/chat/completions", json.dumps(base))
        assert status == 200, (cls, text[:300])

    def post(body, allowed, what, key=KEY, headers=None):
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        status, text = srv.http("POST", "/v1/chat/completions", data, key=key, headers=headers)
        check(status, text, allowed, what)

    values = [None, -1, 0, 1.5, 10 ** 30, -(2 ** 63) - 1, 2 ** 64, "x", "", "\u0000", "é" * 3,
              [], {}, True, [[[]]], {"a": {"b": [1]}}, "9" * 400]
    fields = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
              "seed", "stop", "stream", "stream_options", "n", "user", "fps", "num_frames",
              "start", "end", "video_id", "return_prompt_ids", "media_io_kwargs",
              "mm_processor_kwargs", "logprobs", "top_logprobs"]
    # 1. JSON types: every field with every hostile value (sampled), the rest of the body good.
    for field in fields:
        for v in rng.sample(values, 8):
            post(dict(base, **{field: v}), {200, 400, 404}, (field, v))
    for depth in (63, 64, 65, 1000):
        post('{"model": "model", "n": %s1%s, "messages": []}' % ("[" * depth, "]" * depth),
             {400}, ("depth", depth))
    alive("json types")
    # 2. Message shapes: roles, content kinds and parts mutated.
    parts = [video_part(file_url(fx.clip)), {"type": "text", "text": QUESTION}]
    shapes = [[], [{}], [{"role": 7}], [{"role": "user"}], [{"role": "user", "content": 7}],
              [{"role": "user", "content": [7]}], [{"role": "user", "content": [{"type": 7}]}],
              [{"role": "tool", "content": "x"}], [{"role": "user", "content": [{"type": "text"}]}],
              [{"role": "user", "content": parts * 3}],
              [{"role": "user", "content": [{"type": "text", "text": "x"}] * 2000}],
              [{"role": "user", "content": parts}] * 50]
    for m in shapes:
        post(dict(base, messages=m), {200, 400}, ("messages", str(m)[:80]))
    alive("message shapes")
    # 3. Media URLs and local paths: nothing outside the allowed folder, no other scheme.
    outside = fx.root / "outside.mp4"
    shutil.copy(fx.clip, outside)
    link = fx.media / "link_out.mp4"
    if not os.path.lexists(link):
        os.symlink(outside, link)
    urls = ["http://127.0.0.1:%d/health" % srv.port, "ftp://x/y.mp4", "file:///etc/passwd",
            "file://" + str(fx.media) + "/../outside.mp4", "file://%2e%2e/etc/passwd",
            "file://" + str(link), "file:///dev/zero", "file:///proc/self/environ", "file://",
            "file:relative.mp4", "data:video/mp4;base64,", "data:video/mp4;base64,!!!!",
            "data:text/html;base64,PGI+", "data:video/mp4,rawbytes", "data:video/mp4;base64," +
            base64.b64encode(os.urandom(2000)).decode(), "javascript:alert(1)", "x" * 5000]
    for u in urls:
        for kind in ("video_url", "image_url"):
            part = {"type": kind, kind: {"url": u}}
            post(dict(base, messages=messages(part)), {400, 403}, (kind, u[:80]))
    alive("media urls")
    # 4. Headers, methods and paths.
    for key in (None, "", "Bearer", KEY + "\u00e9", "x" * 8000):
        status, text = srv.http("POST", "/v1/chat/completions", json.dumps(base), key=key)
        check(status, text, {401, 400}, ("key", str(key)[:20]))
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Accept": "text/html"}, {"Expect": "100-continue"},
                    {"X-Junk": "y" * 4000}):
        post(base, {200, 400, 415}, ("headers", headers), headers=headers)
    for method, path in (("DELETE", "/v1/chat/completions"), ("GET", "/v1/chat/completions"),
                         ("GET", "/../../etc/passwd"), ("GET", "/v1/models/../../x"),
                         ("PUT", "/metrics"), ("POST", "/v1/completions")):
        status, text = srv.http(method, path, b"{}" if method in ("POST", "PUT") else None)
        assert status in (400, 404, 405), (method, path, status)
    alive("headers")
    # 5. Idle and half-sent connections hold no one else up.
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(24)]
    for i, sk in enumerate(idle[:12]):
        sk.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GET /he")
    t0 = time.time()
    alive("idle connections")
    assert time.time() - t0 < 10, time.time() - t0
    for sk in idle:
        sk.close()


def uuid_part(uuid, url=None):
    """vLLM's video part with a uuid; without a URL the video is left out (named by the uuid)."""
    return {"type": "video_url", "video_url": {"url": url} if url else None, "uuid": uuid}


def case_uuid_scoped_to_key(fx, srv, ranks):
    # vLLM's per-part uuid: sent once with its video, it names that video's content under the API
    # key that sent it, so a later request may leave the video out.
    hits = lambda m: m["lvx_visual_cache_hits_total"]
    want = qa_json(fx, fx.clip, ranks)["response"]
    first = ask(srv, uuid_part("clip-7", data_url(fx.clip, "video/mp4")))
    assert first.choices[0].message.content == want
    m1 = srv.metrics()
    named = ask(srv, uuid_part("clip-7"))
    m2 = srv.metrics()
    assert named.choices[0].message.content == want
    assert hits(m2) - hits(m1) == ranks, (m1, m2)
    body = lambda part, **kw: json.dumps(
        {"model": "model", "messages": messages(part), "max_tokens": TOKENS, **kw})
    # Another key (another tenant) does not know the name; nor does anyone a name never sent.
    err = expect_error(srv, 400, body(uuid_part("clip-7")), key=KEY2)
    assert err["code"] == "uuid_not_found" and "clip-7" in err["message"], err
    err = expect_error(srv, 400, body(uuid_part("never-sent")))
    assert err["code"] == "uuid_not_found", err
    # The name sent again with other bytes names them from then on (content, never a slot).
    other = qa_json(fx, fx.other, ranks)["response"]
    assert ask(srv, uuid_part("clip-7", data_url(fx.other, "video/mp4"))).choices[0].message.content == other
    assert ask(srv, uuid_part("clip-7")).choices[0].message.content == other
    # Named, but not cached with these frame settings: refused, saying to send the video again.
    err = expect_error(srv, 400, body(uuid_part("clip-7"), num_frames=FRAMES + 2))
    assert "send the video again" in err["message"], err
    # The second key names its own videos; uuids on image_url parts and malformed ones are refused.
    srv.client.api_key = KEY2
    try:
        assert ask(srv, uuid_part("clip-7", file_url(fx.clip))).choices[0].message.content == want
        assert ask(srv, uuid_part("clip-7")).choices[0].message.content == want
    finally:
        srv.client.api_key = KEY
    assert ask(srv, uuid_part("clip-7")).choices[0].message.content == other  # the first key's
    image = {"type": "image_url", "image_url": {"url": data_url(fx.clip, "image/png")}, "uuid": "x"}
    assert "video_url part only" in expect_error(srv, 400, body(image))["message"]
    assert "printable" in expect_error(srv, 400, body(uuid_part("", file_url(fx.clip)) | {"uuid": 7}))["message"]


# (case, server flags (None: the case starts what it needs), environment, ranks it needs, stops
# the server itself)
CASES = [
    (case_answers_equal_lvx_qa, [], {}, 1, False),
    (case_streaming, [], {}, 1, False),
    (case_image_frames, [], {}, 1, False),
    (case_conversation_template, [], {}, 1, False),
    (case_cache_hits_and_changed_file, [], {}, 1, False),
    (case_error_codes, ["--max-body-bytes", str(200 << 10)], {}, 1, False),
    (case_queue_full_429, ["--max-queue", "1", "--max-batch", "1"], {}, 1, False),
    (case_stop_and_disconnect, [], {}, 1, False),
    (case_nonstreaming_client_leaves, ["--max-batch", "1"], {}, 1, False),
    (case_identical_requests_share_generation, ["--max-batch", "1"], {}, 1, False),
    (case_distinct_questions_batched, [], {}, 1, False),
    (case_chunked_prefill, ["--max-batch-tokens", "4"], {}, 1, False),
    (case_sigterm_finishes_in_flight, [], {}, 1, True),
    (case_killed_rank_503, [], {"LVX_DIST_TIMEOUT_S": "4"}, 2, True),
    (case_port_in_use_fails_every_rank_at_once, None, {}, 1, True),
    (case_hostile_bodies, [], {}, 1, False),
    (case_hostile_framing, [], {}, 1, False),
    (case_fuzz, [], {}, 1, False),
    (case_frame_settings_per_request, [], {}, 1, False),
    (case_uploads_stay_private, ["--cache-bytes", "0"], {"LVX_INDEX_CACHE": "@index"}, 1, False),
    (case_api_key_stays_secret, "env-key", {"LVX_API_KEY": KEY}, 1, False),
    (case_api_key_flag_not_in_rank_argv, ["--metrics-public"], {}, 1, False),
    (case_uuid_scoped_to_key, "keys-file", {}, 1, False),
    (case_logprobs, [], {}, 1, False),
    (case_inflight_budget, ["--max-inflight-bytes", str(3 << 20)], {}, 1, False),
]


def main():
    ranks = int(sys.argv[1])
    only = sys.argv[sys.argv.index("-k") + 1] if "-k" in sys.argv else ""
    root = Path(os.environ.get("LVX_SERVE_TEST_DIR",
                               Path(tempfile.gettempdir()) / ("lvx-serve-test-%d" % os.getuid())))
    fx = Fixtures(root)
    # A temporary folder of this run's own, for the servers (TMPDIR) and the cases: ctest runs the
    # 1- and 2-rank suites at once, and a case that looks for upload folders left in a shared
    # /tmp would see the other suite's server at work.
    tmp = fx.root / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    passed = failed = 0
    shared = None  # cases without flags share one server
    for case, flags, env, need, stops in CASES:
        name = "%s[%d ranks]" % (case.__name__[5:], ranks)
        if ranks < need or only not in name:
            continue
        t0 = time.time()
        srv = None
        try:
            env = {k: (str(fx.root / "index") if v == "@index" else v) for k, v in env.items()}
            if "LVX_INDEX_CACHE" in env:
                os.environ["LVX_TEST_INDEX_DIR"] = env["LVX_INDEX_CACHE"]
                Path(env["LVX_INDEX_CACHE"]).mkdir(parents=True, exist_ok=True)
            if flags is None:
                srv = None
            elif flags == "env-key":
                srv = Server(fx, ranks, env=env, key_flag=False)
            elif flags == "keys-file":  # two tenants' keys, one per line
                keys = fx.root / "keys.txt"
                keys.write_text(KEY + "\n" + KEY2 + "\n")
                srv = Server(fx, ranks, "--api-key-file", str(keys), env=env, key_flag=False)
            elif not flags and not env and not stops:
                shared = shared or Server(fx, ranks)
                srv = shared
            else:
                srv = Server(fx, ranks, *flags, env=env)
            done = threading.Event()
            timer = threading.Timer(
                60, lambda: (done.is_set() or srv is None or os.killpg(srv.proc.pid, 9)))
            timer.start()
            try:
                case(fx, srv, ranks)
            finally:
                done.set()
                timer.cancel()
            assert time.time() - t0 < 60, "took %.1f s" % (time.time() - t0)
            passed += 1
            print("PASS %s (%.1f s)" % (name, time.time() - t0), flush=True)
        except Exception:
            failed += 1
            print("FAIL %s (%.1f s)\n%s" % (name, time.time() - t0, traceback.format_exc()),
                  flush=True)
            if srv:
                print("server stderr:\n" + srv.stderr()[-3000:], flush=True)
        finally:
            if srv is not None and srv is not shared and srv.proc.poll() is None:
                srv.stop()
    if shared is not None:
        code = shared.stop()
        if code != 0:
            failed += 1
            print("FAIL shared server exit code %s\n%s" % (code, shared.stderr()[-3000:]))
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
