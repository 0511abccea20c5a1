"""OpenAI semantics that clients script against (issue: `n`, answers that peers accept, a chat
without video): `n` checked against lvx serve's own n = 1 answers, which
case_answers_equal_lvx_qa ties to lvx qa; a text-only chat against the tokenizers package (its
prompt) and the reference model's greedy loop (its answer).
"""
import json
import subprocess
import tempfile
from pathlib import Path

from harness import PY, SOURCE, TOKENS, expect_error, file_url, messages, video_part


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
    assert srv.metrics()["lvx_visual_cache_bytes"] == cache_before
    stream = _ask(srv, video_part(file_url(fx.clip)), temperature=0, max_tokens=20000,
                  stream=True)
    next(iter(stream))
    m = srv.metrics()
    assert m["lvx_requests_running"] == 1 and m["lvx_visual_cache_bytes"] > 0, m
    stream.close()


def case_text_only_chat(fx, srv, ranks):
    # A chat without media is answered: its prompt is the chat template's text-only form (chatml
    # without <|image|>: the tokenizers package's ids of the rendered text), and its greedy answer
    # is the reference model's (tests/reference/mplug_owl3_ref.py generate, fp64, no image) token
    # for token; usage counts that prompt; the visual cache is not touched.
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
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(fx.model / "tokenizer.json"))
    assert ids == tok.encode(chat, add_special_tokens=False).ids, (ids, chat)
    assert got["usage"]["prompt_tokens"] == len(ids), got["usage"]
    with tempfile.TemporaryDirectory() as d:
        import torch
        from safetensors.torch import load_file, save_file
        save_file({"input_ids": torch.tensor([ids])}, d + "/batch.safetensors")
        subprocess.run([PY, str(SOURCE / "tests/reference/mplug_owl3_ref.py"), "generate",
                        str(fx.model), d + "/batch.safetensors", d + "/want.safetensors",
                        "--tokens", str(TOKENS)], check=True, stdout=subprocess.DEVNULL)
        want = load_file(d + "/want.safetensors")["tokens"][0].tolist()
    stops = {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    cut = next((i for i, t in enumerate(want) if t in stops), len(want))
    content = got["choices"][0]["message"]["content"]
    assert content == tok.decode(want[:cut], skip_special_tokens=True), (content, want)
    assert got["usage"]["completion_tokens"] == cut, (got["usage"], want)
    assert srv.metrics()["lvx_visual_cache_bytes"] == 0
    # The openai client's plain string content, streamed, gives the same text.
    streamed = "".join(
        c.choices[0].delta.content or "" for c in srv.client.chat.completions.create(
            model="model", messages=[{"role": "user", "content": question}], temperature=0,
            max_tokens=TOKENS, stream=True) if c.choices)
    assert streamed == content, (streamed, content)
