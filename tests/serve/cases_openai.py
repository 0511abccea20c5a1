"""OpenAI semantics that clients script against (issue: `n`, answers that peers accept, a chat
without video, /v1/completions): `n` checked against lvx serve's own n = 1 answers, which
case_answers_equal_lvx_qa ties to lvx qa; a text-only chat against the tokenizers package (its
prompt) and the reference model's greedy loop (its answer), and so is a completion.
"""
import json
import subprocess
import tempfile
from pathlib import Path

from harness import PY, QUESTION, SOURCE, TOKENS, expect_error, file_url, messages, video_part


def _ask(srv, media, **kw):
    return srv.client.chat.completions.create(model="model", messages=messages(media), **kw)


def case_n_choices(fx, srv, ranks):
    # n choices come back with indexes 0..n-1; with a seed s choice i is the n = 1 answer with
    # seed s + i (so choice 0 is the request's own answer); greedy choices all equal the greedy
    # answer; usage counts every choice's tokens; the later choices reuse the first's prompt
    # prefix (prefilled once); a stream carries each choice by its index, equal to the whole
    # answer's; n beyond 16 is refused naming n.
    media = video_part(file_url(fx.clip))
    hot = dict(temperature=2, max_tokens=8, seed=7)
    got = _ask(srv, media, n=3, **hot)
    assert [c.index for c in got.choices] == [0, 1, 2], got.choices
    singles = [_ask(srv, media, **{**hot, "seed": 7 + i}) for i in range(3)]
    alone = [r.choices[0].message.content for r in singles]
    assert [c.message.content for c in got.choices] == alone, (got.choices, alone)
    assert got.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles), got.usage
    lvx = got.model_extra["lvx"]
    assert [c["visual_cache"]["prefix_reused"] for c in lvx["choices"]] == [True, True], lvx
    one = _ask(srv, media, **hot)
    assert got.usage.prompt_tokens == one.usage.prompt_tokens, (got.usage, one.usage)
    greedy = _ask(srv, media, temperature=0, max_tokens=TOKENS, n=2)
    ref = _ask(srv, media, temperature=0, max_tokens=TOKENS)
    texts = [c.message.content for c in greedy.choices]
    assert texts == [ref.choices[0].message.content] * 2, (texts, ref)
    assert greedy.usage.completion_tokens == 2 * ref.usage.completion_tokens, greedy.usage
    streamed = {}
    usage = None
    for chunk in _ask(srv, media, n=2, stream=True, stream_options={"include_usage": True}, **hot):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
        usage = chunk.usage or usage
    assert streamed == {0: alone[0], 1: alone[1]}, (streamed, alone)
    assert usage.completion_tokens == sum(r.usage.completion_tokens for r in singles[:2]), usage
    err = expect_error(srv, 400, json.dumps({"model": "model", "n": 17, "messages": messages(media)}))
    assert err["param"] == "n", err


def case_cache_gauge_follows_prefill(fx, srv, ranks):
    # lvx_visual_cache_bytes counts a video's features as soon as its prefill kept them, while
    # its answer still runs (it used to change only when an answer ended). A fresh server.
    assert srv.metrics()["lvx_visual_cache_bytes"] == 0
    stream = _ask(srv, video_part(file_url(fx.clip)), temperature=0, max_tokens=20000,
                  stream=True)
    next(iter(stream))
    m = srv.metrics()
    assert m["lvx_requests_running"] == 1 and m["lvx_visual_cache_bytes"] > 0, m
    stream.close()


def _reference_answer(fx, ids):
    """The reference model's greedy continuation of `ids` (tests/reference/mplug_owl3_ref.py
    generate, fp64, no image) cut at the first stop token: (its text, its token count)."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer
    with tempfile.TemporaryDirectory() as d:
        save_file({"input_ids": torch.tensor([ids])}, d + "/batch.safetensors")
        subprocess.run([PY, str(SOURCE / "tests/reference/mplug_owl3_ref.py"), "generate",
                        str(fx.model), d + "/batch.safetensors", d + "/want.safetensors",
                        "--tokens", str(TOKENS)], check=True, stdout=subprocess.DEVNULL)
        want = load_file(d + "/want.safetensors")["tokens"][0].tolist()
    tok = Tokenizer.from_file(str(fx.model / "tokenizer.json"))
    stops = {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    cut = next((i for i, t in enumerate(want) if t in stops), len(want))
    return tok.decode(want[:cut], skip_special_tokens=True), cut


def _tokenizer(fx):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(fx.model / "tokenizer.json"))


def case_text_only_chat(fx, srv, ranks):
    # A chat without media is answered: its prompt is the chat template's text-only form (chatml
    # without <|image|>: the tokenizers package's ids of the rendered text), and its greedy answer
    # is the reference model's token for token; usage counts that prompt; the visual cache is not
    # touched.
    question = "Which colour is the sky?"
    body = {"model": "model", "messages": [{"role": "user", "content": question}],
            "temperature": 0, "max_tokens": TOKENS, "return_prompt_ids": True}
    cache_before = srv.metrics()["lvx_visual_cache_bytes"]
    status, text = srv.http("POST", "/v1/chat/completions", json.dumps(body))
    assert status == 200, (status, text[:300])
    got = json.loads(text)
    ids = got["lvx"]["prompt_ids"]
    chat = ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n" + question +
            "<|im_end|>\n<|im_start|>assistant\n")
    assert ids == _tokenizer(fx).encode(chat, add_special_tokens=False).ids, (ids, chat)
    assert got["usage"]["prompt_tokens"] == len(ids), got["usage"]
    want, count = _reference_answer(fx, ids)
    content = got["choices"][0]["message"]["content"]
    assert content == want, (content, want)
    assert got["usage"]["completion_tokens"] == count, (got["usage"], count)
    assert srv.metrics()["lvx_visual_cache_bytes"] == cache_before
    # The openai client's plain string content, streamed, gives the same text.
    streamed = "".join(
        c.choices[0].delta.content or "" for c in srv.client.chat.completions.create(
            model="model", messages=[{"role": "user", "content": question}], temperature=0,
            max_tokens=TOKENS, stream=True) if c.choices)
    assert streamed == content, (streamed, content)


def case_completions(fx, srv, ranks):
    # POST /v1/completions continues a prompt as written: the tokenizers package's ids of it (its
    # special tokens parsed), and the reference model's greedy continuation token for token; the
    # openai client's completions API reads it, whole and streamed; the legacy fields lvx does not
    # apply, several prompts and a prompt holding the media token are refused naming the field.
    # Media parts in the prompt put the frames where they stand.
    prompt = "<|im_start|>user\nWhich colour is the sky?<|im_end|>\n<|im_start|>assistant\n"
    body = {"model": "model", "prompt": prompt, "temperature": 0, "max_tokens": TOKENS,
            "return_prompt_ids": True}
    status, text = srv.http("POST", "/v1/completions", json.dumps(body))
    assert status == 200, (status, text[:300])
    got = json.loads(text)
    assert got["object"] == "text_completion" and got["id"].startswith("cmpl-"), got
    ids = _tokenizer(fx).encode(prompt, add_special_tokens=True).ids
    assert got["lvx"]["prompt_ids"] == ids, (got["lvx"]["prompt_ids"], ids)
    want, count = _reference_answer(fx, ids)
    assert got["choices"][0]["text"] == want, (got["choices"], want)
    assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": count,
                            "total_tokens": len(ids) + count}, got["usage"]
    whole = srv.client.completions.create(model="model", prompt=prompt, temperature=0,
                                          max_tokens=TOKENS)
    assert whole.choices[0].text == want and whole.choices[0].finish_reason, whole
    pieces = list(srv.client.completions.create(model="model", prompt=[prompt], temperature=0,
                                                max_tokens=TOKENS, stream=True))
    assert "".join(c.choices[0].text for c in pieces if c.choices) == want, pieces
    assert pieces[-1].choices[0].finish_reason is not None, pieces[-1]
    for field, value in (("echo", True), ("suffix", "x"), ("logprobs", 2), ("messages", [])):
        err = expect_error(srv, 400, json.dumps({"model": "model", "prompt": prompt, field: value}),
                           path="/v1/completions")
        assert err["param"] == field, (field, err)
    for bad in (["a", "b"], [1, 2], ""):
        err = expect_error(srv, 400, json.dumps({"model": "model", "prompt": bad}),
                           path="/v1/completions")
        assert err["param"] == "prompt", (bad, err)
    err = expect_error(srv, 400, json.dumps({"model": "model", "prompt": "<|image|>What?"}),
                       path="/v1/completions")
    assert err["param"] == "prompt" and "media token" in err["message"], err
    # Media as content parts: the frames go where the video_url part stands. Written as the chat
    # template writes a question, the prompt's ids and the greedy answer are the chat's (which
    # case_answers_equal_lvx_qa ties to lvx qa).
    chat = json.loads(srv.http("POST", "/v1/chat/completions", json.dumps({
        "model": "model", "messages": messages(video_part(file_url(fx.clip))), "temperature": 0,
        "max_tokens": TOKENS, "return_prompt_ids": True}))[1])
    parts = [{"type": "text", "text": "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n"},
             video_part(file_url(fx.clip)),
             {"type": "text", "text": "\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n"}]
    status, text = srv.http("POST", "/v1/completions", json.dumps({
        "model": "model", "prompt": parts, "temperature": 0, "max_tokens": TOKENS,
        "return_prompt_ids": True}))
    assert status == 200, (status, text[:300])
    media = json.loads(text)
    assert media["lvx"]["prompt_ids"] == chat["lvx"]["prompt_ids"], (media["lvx"], chat["lvx"])
    assert media["choices"][0]["text"] == chat["choices"][0]["message"]["content"], (media, chat)
    assert media["lvx"]["frames"] == chat["lvx"]["frames"] > 0, media["lvx"]
    apart = [parts[0], video_part(file_url(fx.clip)), parts[2], video_part(file_url(fx.other))]
    err = expect_error(srv, 400, json.dumps({"model": "model", "prompt": apart}),
                       path="/v1/completions")
    assert err["param"] == "prompt", err
