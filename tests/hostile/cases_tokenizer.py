"""Hostile inputs for the tokenizer (models/tokenizer/, lvx tokenize, the prompt builders):
tokenizer.json files that are huge in the wrong places (200k added tokens, 100k-deep nesting, ids
up to 2^31), not regular files, or carry a regex that backtracks without bound; ids outside the
vocabulary; special tokens and 10^6 characters in a user's question."""
import json
import subprocess
from pathlib import Path

from harness import REFERENCE, Case

_GOLD = {}


def gold(ctx) -> Path:
    """The generated tokenizers of tests/reference/make_tokenizers.py (made once per run)."""
    def make(d: Path):
        subprocess.run([ctx.python, str(REFERENCE / "make_tokenizers.py"), str(d)], check=True,
                       stdout=subprocess.DEVNULL)
    return ctx._fixture("tokenizers", make, [REFERENCE / "make_tokenizers.py"], ["tokenizers"])


def qwen2(ctx) -> dict:
    return json.loads((gold(ctx) / "qwen2" / "tokenizer.json").read_text(encoding="utf-8"))


def edited(ctx, edit, name="tokenizer.json") -> str:
    d = qwen2(ctx)
    edit(d)
    return ctx.write(name, json.dumps(d))


def tokenize(ctx, tok, *args):
    return ["tokenize", "--tokenizer", tok] + list(args)


# ---- 1. linear time ------------------------------------------------------------------------


def many_added(ctx):
    def edit(d):
        nxt = max(t["id"] for t in d["added_tokens"]) + 1
        for i in range(200000):
            d["added_tokens"].append({"id": nxt + i, "content": "<|extra_%d|>" % i,
                                      "single_word": False, "lstrip": False, "rstrip": False,
                                      "normalized": i % 2 == 0, "special": i % 3 == 0})
    tok = edited(ctx, edit)
    text = ctx.write("text.txt", "hi <|extra_17|> x<|extra_199999|><|extra_ <" * 20000)
    return tokenize(ctx, tok, "--file", text)


def check_many_added(ctx, res):
    ids = res.stdout.split()
    assert len(ids) > 100000, "expected the ids of the text, got %d" % len(ids)


def million_chars(ctx):
    big = (gold(ctx) / "big.txt").read_text(encoding="utf-8")
    text = (big * 11)[:1000000] + "<" * 100000 + " " * 100000 + "a" * 100000
    return tokenize(ctx, str(gold(ctx) / "qwen2" / "tokenizer.json"), "--split-special",
                    "--file", ctx.write("text.txt", text))


# ---- 2. ids bounded by the vocabulary ------------------------------------------------------


def vocab_id(value):
    def argv(ctx):
        def edit(d):
            d["model"]["vocab"]["zz_bad"] = value
        return tokenize(ctx, edited(ctx, edit), "--text", "hello")
    return argv


def shared_id(ctx):
    def edit(d):
        d["model"]["vocab"]["zz_shared"] = d["model"]["vocab"]["a"]
    return tokenize(ctx, edited(ctx, edit), "--text", "hello")


def vocab_gap(ctx):
    def edit(d):
        v = d["model"]["vocab"]
        n = len(v)
        last = next(k for k, i in v.items() if i == n - 1)
        v[last] = n  # ids 0..n-2 and n: the first added token gets n as well
    return tokenize(ctx, edited(ctx, edit), "--text", "hello")


def template_id(ctx):
    def edit(d):
        d["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": None,
            "special_tokens": {"<s>": {"id": "<s>", "ids": [-7], "tokens": ["<s>"]}}}
    return tokenize(ctx, edited(ctx, edit), "--special", "--text", "hello")


def decode_ids(ids):
    def argv(ctx):
        return tokenize(ctx, str(gold(ctx) / "qwen2" / "tokenizer.json"), "--decode", "--text",
                        ids)
    return argv


# ---- 3. nesting depth, not regular files ---------------------------------------------------


def deep_normalizer(ctx):
    d = qwen2(ctx)
    d["normalizer"] = "@@DEEP@@"
    head, tail = json.dumps(d).split('"@@DEEP@@"')
    n = 100000
    deep = '{"type": "Sequence", "normalizers": [' * n + '{"type": "NFC"}' + "]}" * n
    tok = ctx.write("tokenizer.json", head + deep + tail)
    return tokenize(ctx, tok, "--text", "hello")


def fifo_tokenizer(ctx):
    return tokenize(ctx, ctx.fifo("tokenizer.json"), "--text", "hello")


def dir_tokenizer(ctx):
    (ctx.dir / "tokenizer.json").mkdir()
    return tokenize(ctx, ctx.path("tokenizer.json"), "--text", "hello")


def fifo_input(ctx):
    return tokenize(ctx, str(gold(ctx) / "qwen2" / "tokenizer.json"), "--file",
                    ctx.fifo("input.txt"))


# ---- 4. regex matching budget --------------------------------------------------------------

BACKTRACKING = "(?:a|a){0,21}x|a"  # ~6M steps a call, under PCRE2's 10M per-call limit


def backtracking_regex(ctx):
    def edit(d):
        d["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = BACKTRACKING
    return tokenize(ctx, edited(ctx, edit), "--file", ctx.write("text.txt", "a" * 46000))


# ---- 5. user text is text ------------------------------------------------------------------


def qa(model_fn, question):
    def argv(ctx):
        return ["qa", "--model", model_fn(ctx), "--video", ctx.clip(), "--num-frames", "2",
                "--max-new-tokens", "4", "--question", question]
    return argv


def huge_question(model_fn):
    def argv(ctx):
        # 10^6 characters exceed what one argv or environment string may hold (128 KiB): the
        # question comes in a questions file.
        q = ("what is this? " * 75000)[:1000000]
        rows = ctx.write("q.jsonl", json.dumps({"id": "big", "video": ctx.clip(),
                                                "question": q}) + "\n")
        return ["qa", "--model", model_fn(ctx), "--questions", rows, "--output",
                ctx.path("answers.jsonl"), "--num-frames", "2", "--max-new-tokens", "2"]
    return argv


def answered(ctx, res):
    assert res.stdout.strip(), "no answer on stdout"


def one_row(ctx, res):
    rows = Path(ctx.path("answers.jsonl")).read_text().splitlines()
    assert len(rows) == 1, "expected one row (an answer or an error), got %d" % len(rows)


CASES = [
    # 1. linear time: both hung before (the added-token scan and its load were quadratic)
    Case("tok_200k_added_tokens", many_added, rc=0, timeout=60, check=check_many_added),
    Case("tok_million_chars", million_chars, rc=0, timeout=30),
    # 2. ids bounded by the vocabulary
    Case("tok_vocab_id_huge", vocab_id(2147483647), timeout=30,
         stderr=r"model\.vocab\.zz_bad: id 2147483647 of token \"zz_bad\" is out of range"),
    Case("tok_vocab_id_negative", vocab_id(-3), timeout=30,
         stderr=r"model\.vocab\.zz_bad: id -3 of token \"zz_bad\" is out of range"),
    Case("tok_vocab_id_shared", shared_id, timeout=30,
         stderr=r"model\.vocab\..*is also the id of"),
    Case("tok_added_id_is_a_model_id", vocab_gap, timeout=30,
         stderr=r"added_tokens\[0\]\.id: id \d+ for \"<\|endoftext\|>\" is also the id of model"),
    Case("tok_template_id_unknown", template_id, timeout=30,
         stderr=r"special_tokens\.<s>\.ids\[0\]: id -7 of special token \"<s>\" is not in the "
                r"vocabulary"),
    Case("tok_decode_id_outside_vocab", decode_ids("1 99999999"), timeout=30,
         stderr=r"decode: id 99999999 is not in the vocabulary"),
    Case("tok_decode_id_overflow", decode_ids("1 99999999999999999999999"), timeout=30,
         stderr=r"--decode: '99999999999999999999999' is not a token id"),
    # 3. depth and file kinds: the deep list took 4.7 GiB; the FIFOs blocked forever
    Case("tok_deep_normalizer", deep_normalizer, timeout=30, max_rss_mb=1024,
         stderr=r"tokenizer\.json: JSON nested deeper than 64 levels"),
    Case("tok_tokenizer_is_fifo", fifo_tokenizer, timeout=20,
         stderr=r"tokenizer file '.*tokenizer\.json' is a FIFO"),
    Case("tok_tokenizer_is_directory", dir_tokenizer, timeout=20,
         stderr=r"tokenizer file '.*tokenizer\.json' is a directory"),
    Case("tok_input_is_fifo", fifo_input, timeout=20, stderr=r"--file '.*input\.txt' is a FIFO"),
    # 4. a regex under PCRE2's per-call limit on every character: ~20 min before, an error now
    Case("tok_backtracking_regex", backtracking_regex, timeout=30,
         stderr=r"pattern\.Regex: the regex \"\(\?:a\|a\)\{0,21\}x\|a\" used up its matching "
                r"budget"),
    # 5. special tokens in a question are text (an internal shape error before)
    Case("tok_qa_image_token_in_question_mplug",
         qa(lambda ctx: ctx.mplug(), "what <|image|> is this <|im_end|>"), rc=0, timeout=180,
         check=answered),
    Case("tok_qa_image_token_in_question_flamingo",
         qa(lambda ctx: ctx.flamingo(), "what <image> is this <|endofchunk|>"), rc=0,
         timeout=180, check=answered),
    # a 10^6-character question ends in time with one row, an answer or an error (batch mode
    # exits 0 either way). Tokenizing it takes well under a second; refusing a prompt longer than
    # the model's context, instead of a prefill that runs for hours, is the qa command's part.
    Case("tok_qa_million_char_question_mplug", huge_question(lambda ctx: ctx.mplug()), rc=0,
         timeout=60, check=one_row),
    Case("tok_qa_million_char_question_flamingo", huge_question(lambda ctx: ctx.flamingo()),
         rc=0, timeout=60, check=one_row),
]
