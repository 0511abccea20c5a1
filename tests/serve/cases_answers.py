"""lvx serve cases: answers and the chat API's shapes, each against an independent reference.

Answers and usage against `lvx qa --json` (file://, data: and image_url frames, streamed and not);
a conversation's prompt ids against the tokenizers package on the chat text written out, and its
answer and logprobs against `lvx forward --generate` on those ids; per-request frame settings.
"""
import json
import subprocess
import tempfile
from pathlib import Path

from harness import (
    LVX, QUESTION, FRAMES, TOKENS, qa_json, video_part, messages, ask, file_url, data_url,
    expect_error)


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
    before = srv.metrics()
    stream = ask(srv, video_part(file_url(fx.clip)), stream=True,
                 stream_options={"include_usage": True})
    text, finish, usage, chunks, pieces = "", None, None, 0, 0
    for ch in stream:
        assert ch.object == "chat.completion.chunk"
        chunks += 1
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            text += c.delta.content or ""
            pieces += 1 if c.delta.content else 0
            finish = c.finish_reason or finish
    assert text == want["response"], (text, want["response"])
    assert finish == want["finish_reason"]
    assert usage and usage.completion_tokens == want["completion_tokens"]
    assert chunks >= 3  # role, content pieces, finish
    # The latency histograms counted this request: its queue wait, its end, and a gap between
    # each two of its text pieces; every histogram's +Inf bucket is its count, buckets cumulative.
    after = srv.metrics()
    grew = lambda name: after[name + "_count"] - before.get(name + "_count", 0)
    assert grew("lvx_queue_seconds") >= 1 and grew("lvx_request_seconds") >= 1
    assert grew("lvx_time_to_first_token_seconds") >= 1
    assert grew("lvx_inter_token_seconds") >= pieces - 1 >= 1, (pieces, after)
    for name in ("lvx_queue_seconds", "lvx_time_to_first_token_seconds",
                 "lvx_inter_token_seconds", "lvx_request_seconds"):
        buckets = [v for k, v in after.items() if k.startswith(name + "_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == after[name + "_count"], (name, buckets)
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
