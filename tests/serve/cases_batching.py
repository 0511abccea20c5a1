"""lvx serve cases: scheduling and batching.

The queue's limit (429), stop strings and clients that leave (their generation stops), identical
requests answered by one generation, distinct questions batched in one decode step and chunked
prefill between decode steps, each answer still `lvx qa`'s token for token.
"""
import concurrent.futures
import json
import time

from harness import KEY, QUESTION, TOKENS, qa_json, video_part, messages, ask, file_url


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
    # each answer is lvx qa's for its question, token for token. The server runs with
    # --step-overlap on (each step's visual-key calls on a second thread; auto leaves it off on
    # a 2-core machine), so the overlapped step is checked end to end too.
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
    # --max-batch-tokens 4: a cache miss's prompt prefix runs in chunks of at most 4 tokens (its
    # frames decoded and encoded on a worker thread of each rank), one chunk between two decode
    # steps, while questions about a cached video run; --max-batch-visual-keys 128 cuts the chunks
    # late in the prompt shorter (there each token reads many frames' keys: 16 per frame), the
    # same cut on every rank. Every answer equals lvx qa's with the same flags token for token
    # (the same chunks give the same bits), the miss's also lvx qa's whole prefill's, and
    # /metrics counts the miss's chunks: more than ceil(prefix tokens / 4), at most one per token.
    chunks = ("--max-batch-tokens", "4", "--max-batch-visual-keys", "128")
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
    assert prefix > 8 and -(-prefix // 4) < ran <= prefix, (prefix, ran)
