"""lvx serve cases: errors and limits.

Every error code with OpenAI's error shape, hostile bodies and HTTP framing, the in-flight byte
budget, and a seeded fuzz of hostile requests by class; after each, the server still answers.
"""
import base64
import json
import os
import shutil
import time

import openai

from harness import (
    KEY, QUESTION, qa_json, video_part, messages, ask, file_url, data_url, expect_error, raw_http)


def case_error_codes(fx, srv, ranks):
    ok = json.dumps({"model": "model", "messages": messages(video_part(file_url(fx.clip)))})
    expect_error(srv, 400, "{not json")
    expect_error(srv, 400, json.dumps({"model": "model", "messages": "hi"}))
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
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for field, value, instead in (("logprobs", "yes", None),
                                  ("logit_bias", {"5": 1}, "send {} or leave it out"),
                                  ("tools", [tool], "describe the tool's output format"),
                                  ("response_format", {"type": "json_object"}, "in the prompt"),
                                  ("frequency_penalty", 1, "send 0 or leave it out")):
        err = expect_error(srv, 400, json.dumps({"model": "model", field: value, "messages": good}))
        assert err["param"] == field and field in err["message"], err
        assert instead is None or instead in err["message"], err  # says what to do instead
    # What peers accept as defaults (a penalty of 0, no tools, a text format) is accepted.
    neutral = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "tools": [],
               "tool_choice": "none", "response_format": {"type": "text"}}
    got, text = srv.http("POST", "/v1/chat/completions",
                         json.dumps({"model": "model", "messages": good, "max_tokens": 2, **neutral}))
    assert got == 200, (got, text)
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


def _fuzz_check(status, text, allowed, what):
    """A fuzz answer: a status the class allows and, when not 200, a clean OpenAI error object."""
    assert status in allowed, (what, status, text[:300])
    if status != 200:
        err = json.loads(text)["error"]
        assert isinstance(err["message"], str) and err["message"] and "type" in err, text
        assert ".cpp" not in text and "lvx-serve-" not in text, (what, text[:300])


def _fuzz_alive(srv, base, cls):
    """After a fuzz class: /health answers and so does a good request."""
    assert srv.http("GET", "/health", key=None)[0] == 200, cls
    status, text = srv.http("POST", "/v1/chat/completions", json.dumps(base))
    assert status == 200, (cls, text[:300])


def _fuzz_post(srv, body, allowed, what, key=KEY, headers=None):
    """POSTs one fuzz body (a dict is JSON-encoded) and checks the answer."""
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    status, text = srv.http("POST", "/v1/chat/completions", data, key=key, headers=headers)
    _fuzz_check(status, text, allowed, what)


def _fuzz_json_types(srv, base, rng):
    """Fuzz class 1, JSON types: every field with hostile values (sampled), the rest good; depth."""
    values = [None, -1, 0, 1.5, 10 ** 30, -(2 ** 63) - 1, 2 ** 64, "x", "", "\u0000", "é" * 3,
              [], {}, True, [[[]]], {"a": {"b": [1]}}, "9" * 400]
    fields = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
              "seed", "stop", "stream", "stream_options", "n", "user", "fps", "num_frames",
              "start", "end", "video_id", "return_prompt_ids", "media_io_kwargs",
              "mm_processor_kwargs", "logprobs", "top_logprobs"]
    for field in fields:
        for v in rng.sample(values, 8):
            _fuzz_post(srv, dict(base, **{field: v}), {200, 400, 404}, (field, v))
    for depth in (63, 64, 65, 1000):
        body = '{"model": "model", "n": %s1%s, "messages": []}' % ("[" * depth, "]" * depth)
        _fuzz_post(srv, body, {400}, ("depth", depth))
    _fuzz_alive(srv, base, "json types")


def _fuzz_message_shapes(fx, srv, base):
    """Fuzz class 2, message shapes: roles, content kinds and parts mutated."""
    parts = [video_part(file_url(fx.clip)), {"type": "text", "text": QUESTION}]
    shapes = [[], [{}], [{"role": 7}], [{"role": "user"}], [{"role": "user", "content": 7}],
              [{"role": "user", "content": [7]}], [{"role": "user", "content": [{"type": 7}]}],
              [{"role": "tool", "content": "x"}], [{"role": "user", "content": [{"type": "text"}]}],
              [{"role": "user", "content": parts * 3}],
              [{"role": "user", "content": [{"type": "text", "text": "x"}] * 2000}],
              [{"role": "user", "content": parts}] * 50]
    for m in shapes:
        _fuzz_post(srv, dict(base, messages=m), {200, 400}, ("messages", str(m)[:80]))
    _fuzz_alive(srv, base, "message shapes")


def _fuzz_media_urls(fx, srv, base):
    """Fuzz class 3, media URLs and paths: nothing outside the allowed folder, no other scheme."""
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
            _fuzz_post(srv, dict(base, messages=messages(part)), {400, 403}, (kind, u[:80]))
    _fuzz_alive(srv, base, "media urls")


def _fuzz_headers(srv, base):
    """Fuzz class 4: API keys, headers, methods and paths."""
    for key in (None, "", "Bearer", KEY + "\u00e9", "x" * 8000):
        status, text = srv.http("POST", "/v1/chat/completions", json.dumps(base), key=key)
        _fuzz_check(status, text, {401, 400}, ("key", str(key)[:20]))
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Accept": "text/html"}, {"Expect": "100-continue"},
                    {"X-Junk": "y" * 4000}):
        _fuzz_post(srv, base, {200, 400, 415}, ("headers", headers), headers=headers)
    for method, path in (("DELETE", "/v1/chat/completions"), ("GET", "/v1/chat/completions"),
                         ("GET", "/../../etc/passwd"), ("GET", "/v1/models/../../x"),
                         ("PUT", "/metrics"), ("POST", "/v1/completions")):
        status, text = srv.http(method, path, b"{}" if method in ("POST", "PUT") else None)
        assert status in (400, 404, 405), (method, path, status)
    _fuzz_alive(srv, base, "headers")


def _fuzz_idle_connections(srv, base):
    """Fuzz class 5: idle and half-sent connections hold no one else up."""
    import socket
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(24)]
    for i, sk in enumerate(idle[:12]):
        sk.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GET /he")
    t0 = time.time()
    _fuzz_alive(srv, base, "idle connections")
    assert time.time() - t0 < 10, time.time() - t0
    for sk in idle:
        sk.close()


def case_fuzz(fx, srv, ranks):
    # A bounded fuzz of hostile requests by class (seeded; about 400 requests): every answer is a
    # status the class allows with, when not 200, OpenAI's error object naming no source file or
    # temporary path; after each class the server is alive (/health) and answers a good request.
    import random
    rng = random.Random(31)
    good = messages(video_part(file_url(fx.clip)))
    base = {"model": "model", "messages": good, "max_tokens": 2}
    _fuzz_json_types(srv, base, rng)
    _fuzz_message_shapes(fx, srv, base)
    _fuzz_media_urls(fx, srv, base)
    _fuzz_headers(srv, base)
    _fuzz_idle_connections(srv, base)
