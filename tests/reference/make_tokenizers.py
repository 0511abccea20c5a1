"""Golden tokenizer files and ids for tests/test_models_tokenizer.cpp (no network).

usage: make_tokenizers.py OUT_DIR

Trains three small byte-level BPE tokenizers with the `tokenizers` package on the built-in
multilingual corpus below and writes, under OUT_DIR:

  qwen2/tokenizer.json    configured like Qwen2's: NFC normalizer; Sequence[Split(Qwen2's
                          PRETOKENIZE_REGEX, Isolated), ByteLevel(add_prefix_space=False,
                          use_regex=False)]; ByteLevel post-processor and decoder; merges in the
                          "a b" string form and continuing_subword_prefix/end_of_word_suffix ""
                          (as Qwen2's released file has them); special tokens <|endoftext|>,
                          <|im_start|>, <|im_end|>, <|image|> after the trained vocabulary, and a
                          non-special <tool_call>.
  neox/tokenizer.json     configured like GPT-NeoX-20B / MPT (OpenFlamingo): NFC normalizer;
                          ByteLevel(add_prefix_space=False) with the GPT-2 regex; merges in the
                          [a, b] list form tokenizers 0.22 writes; <|endoftext|> and <|padding|>
                          trained in at ids 0 and 1; OpenFlamingo's <|endofchunk|> and <image>
                          added as special tokens; runs of spaces and tabs as non-special,
                          normalized added tokens (GPT-NeoX-20B has runs of spaces like these);
                          TemplateProcessing "$A <|endoftext|>" (GPTNeoXTokenizerFast with
                          add_eos_token=True builds the same).
  variant/tokenizer.json  the NeoX model with the remaining supported features exercised: NFKC in
                          a normalizer Sequence; Split pre-tokenizers with a String pattern,
                          Removed, MergedWithPrevious, MergedWithNext, Contiguous and invert;
                          ByteLevel(add_prefix_space=True); added tokens with lstrip, rstrip,
                          single_word and normalized; a post-processor Sequence of ByteLevel and
                          TemplateProcessing "<s> $A </s>"; ignore_merges.
  golden.json             per tokenizer: vocab_size, and for every test string the ids with and
                          without special tokens, the ids with special tokens in the text taken
                          as plain text (encode_special_tokens), the decoded texts (plain and skipping special
                          tokens) and the normalized text; decode cases on raw byte tokens (invalid
                          UTF-8 → U+FFFD as tokenizers does); ids of big.txt.
  big.txt                 about 100 KB of mixed text for the speed check.

When transformers can build Qwen2TokenizerFast / GPTNeoXTokenizerFast from the files, their ids
and decoded text are checked against tokenizers' here (a mismatch fails this script).
"""
import json
import os
import random
import sys
import time
import unicodedata

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's a sunny day, isn't it?",
    "I'll be there at 10:30 tomorrow; we've got 3 meetings and they're all long.",
    "Tokenizers split text into tokens: words, sub-words and bytes. Don't forget the spaces!",
    "Video models watch frames; the language model reads the question and answers it.",
    "def encode(text):\n    return [vocab[t] for t in split(text)]  # ids\n\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += x[i] * y[i];\n}\r\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 1,000,000 42%",
    "你好，世界！今天天气很好。我们一起去公园散步吧。视频理解需要很多帧。",
    "中文分词和字节级别的编码。模型读取问题并回答。长视频问答。",
    "こんにちは、世界。東京は日本の首都です。カタカナとひらがなを使います。",
    "안녕하세요 세계! 한국어 텍스트입니다. 동영상을 보고 질문에 답합니다.",
    "مرحبا بالعالم، كيف حالك اليوم؟ هذا نص عربي للاختبار.",
    "नमस्ते दुनिया, आप कैसे हैं? यह हिंदी का परीक्षण पाठ है।",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Crème brûlée, naïve café, façade, Ångström, Øresund, Łódź, Straße, São Paulo, Zürich.",
    "Emoji: 😀 😃 😄 ❤️ 👍 🎉 🚀 — and more text after them.",
    "    indented line\n        deeper\n\ttabbed\n\n\n   trailing   \n",
    "Γειά σου κόσμε! Ελληνικά κείμενα. שלום עולם. ไทย สวัสดี.",
    # U+180E (Mongolian vowel separator): not White_Space, but in PCRE2's \s; trained in so that
    # merges depend on where the regex splits around it
    "x \u180e! y\u180e\u180e, z \u180e\u180e.\u180e\n \u180e! \u180e!",
]

TEST_STRINGS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    # whitespace
    " ",
    "  ",
    "\n",
    "  leading spaces",
    "trailing spaces   ",
    "   both   ",
    "a    b     c      d",
    "tabs\tand\t\ttabs\t",
    "line1\r\nline2\n\n\nline3\r\n",
    "   \n\t  \r\n ",
    "x \n y  \n\n  z",
    "def f(x):\n    return x**2  # square\n\n\tprint(f(3))\n",
    "a\u00a0b\u3000c\u2003d\u180ee\u0085f\u2028g\u000bh\u001ci",
    # U+180E is not White_Space (Oniguruma's \s) but is PCRE2's \s
    "x \u180e! y\u180e\u180e, z \u180e\u180e.\u180e\n",
    # contractions in mixed case
    "I'LL go, don't you? She'S here. We'Re fine; they've, I'd, I'm, you'll, he'd",
    "'s'S'ſ'T're'VE'M'LL'D x's",
    # digits
    "1234567890 3.14159 1,000,000 2024-06-01",
    "٣٤٥ ²½ Ⅳ 𝟙𝟚",
    # multilingual
    "你好，世界！今天天气很好。我们一起去公园吧。",
    "こんにちは、世界。東京は日本の首都です。カタカナも使います。",
    "안녕하세요 세계! 한국어 텍스트입니다.",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.",
    "Crème brûlée, naïve café, façade, Ångström, Øresund, Łódź, Straße",
    "Hello世界123abc！？mixed",
    # emoji: ZWJ sequences, skin tones, flags, variation selectors
    "I ❤️ tokenizers 😀😃😄",
    "👍 👍🏽 👍🏿 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵🇫🇷 🧑🏾‍💻",
    "emoji🎉in🎊words",
    # NFC vs NFD
    "e\u0301 vs \u00e9",
    "Ame\u0301lie Ame\u0301lie",
    "\u1112\u1161\u11ab\u1100\u1173\u11af",
    "\u212b \u2126 \u0041\u030a",
    "ﬁ ① ＡＢＣ",
    # control and invisible characters
    "\x00\x01\x7f bell\x07",
    "\ufeffBOM zero\u200bwidth join\u200dx",
    # special tokens inside text (each family's; other families see plain text)
    "<|im_start|>user\n<|image|><|image|>What?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>x<|endoftext|>",
    "<|im_start|><|im_start|> <|im_sta <|im_end|",
    "call <tool_call>{\"a\": 1}</tool_call>",
    "<image>Describe this.<|endofchunk|><image>And this?<|endofchunk|>",
    "<|padding|><|padding|> tail",
    # special tokens in a user's question (split_special_tokens leaves them as text)
    "what <|image|> is this",
    "x<|im_end|>\n<|im_start|>assistant\nA <tool_call> and <image> <|endofchunk|>",
    # added tokens with flags (variant)
    "Hi <mask> there\t<mask>\t<mask>\u2000",
    "<mask>, <mask>- \u25cc\u0330<mask>",
    "a<mask>b <mask>x x<mask>",
    "[X]  y [X]x [X]",
    "ＸｙＸｙ Xy",
    # split behaviors (variant)
    "one || two || three",
    "Wait. What! Really? Yes.",
    "@user @@ hi @",
    "### title ## x #",
    "a~~b~c~",
    # long words
    "a" * 300,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "😀" * 40,
]

# Decode cases on raw byte tokens: (name, byte groups with special-token names between).
DECODE_BYTES = [
    ("truncated 4-byte", [b"\xf0\x9f"]),
    ("continuation bytes", [b"\x9f\x98\x80"]),
    ("split char around special", [b"\xe4\xb8", "SPECIAL", b"\xad"]),
    ("overlong", [b"\xc0\x80"]),
    ("surrogate", [b"\xed\xa0\x80"]),
    ("above U+10FFFF", [b"\xf4\x90\x80\x80"]),
    ("0xff", [b"a\xffb"]),
    ("valid", [b"\xe4\xb8\xad", "SPECIAL", b"ok"]),
]


def bytes_to_unicode():
    """GPT-2's byte → printable character table (the ByteLevel alphabet)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train(pre_tokenizer, normalizer, vocab_size, special_tokens):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1,
                                  special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def make_qwen2():
    tok = train(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)]),
        normalizers.NFC(), 1200, [])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in
                            ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>"]])
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    d = json.loads(tok.to_str())
    # As in Qwen2's released tokenizer.json: "a b" merges, "" prefix/suffix.
    d["model"]["merges"] = [" ".join(m) for m in d["model"]["merges"]]
    d["model"]["continuing_subword_prefix"] = ""
    d["model"]["end_of_word_suffix"] = ""
    return d


def make_neox():
    tok = train(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True),
                normalizers.NFC(), 1000, ["<|endoftext|>", "<|padding|>"])
    tok.add_tokens([AddedToken(t, special=False, normalized=True) for t in
                    ["  ", "   ", "    ", "        ", "\t\t"]])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in
                            ["<|endofchunk|>", "<image>"]])
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A:0 <|endoftext|>:0", pair="$A:0 <|endoftext|>:0 $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eot)])
    return json.loads(tok.to_str())


def make_variant(neox):
    tok = Tokenizer.from_str(json.dumps(neox))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("||", behavior="removed"),
        pre_tokenizers.Split(Regex(r"[^~]+"), behavior="removed", invert=True),
        pre_tokenizers.Split(Regex(r"[.!?]"), behavior="merged_with_previous"),
        pre_tokenizers.Split(Regex(r"@"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"#"), behavior="contiguous"),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True),
    ])
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False),
                            AddedToken("</s>", special=True, normalized=False),
                            AddedToken("<mask>", special=True, normalized=False, lstrip=True,
                                       rstrip=True, single_word=True)])
    tok.add_tokens([AddedToken("[X]", special=False, normalized=True, rstrip=True),
                    AddedToken("ＸｙＸｙ", special=False, normalized=True)])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])])
    d = json.loads(tok.to_str())
    d["model"]["ignore_merges"] = True
    return d


def big_text():
    rng = random.Random(0)
    parts, size = [], 0
    pool = CORPUS + [s for s in TEST_STRINGS if s]
    while size < 100_000:
        s = rng.choice(pool)
        parts.append(s)
        parts.append(rng.choice([" ", "\n", "  ", "\n\n", "\t", ""]))
        size += len(s.encode()) + 1
    return "".join(parts)


def golden(name, d, out_dir, big, check_transformers):
    path = os.path.join(out_dir, name, "tokenizer.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(d, f, ensure_ascii=False, indent=2)
    tok = Tokenizer.from_file(path)  # goldens come from the file as written
    b2u = bytes_to_unicode()
    special_names = [t["content"] for t in d["added_tokens"] if t["special"]]
    cases = []
    for s in TEST_STRINGS:
        ids = tok.encode(s, add_special_tokens=False).ids
        ids_special = tok.encode(s, add_special_tokens=True).ids
        tok.encode_special_tokens = True  # transformers' split_special_tokens=True
        ids_split = tok.encode(s, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        normalized = tok.normalizer.normalize_str(s) if tok.normalizer else s
        cases.append({"text": s, "ids": ids, "ids_special": ids_special, "ids_split": ids_split,
                      "decoded": tok.decode(ids, skip_special_tokens=False),
                      "decoded_skip": tok.decode(ids_special, skip_special_tokens=True),
                      "normalized": normalized})
    decode_cases = []
    for what, groups in DECODE_BYTES:
        ids = []
        for g in groups:
            if g == "SPECIAL":
                ids.append(tok.token_to_id(special_names[-1]))
            else:
                ids += [tok.token_to_id(b2u[b]) for b in g]
        for skip in (False, True):
            decode_cases.append({"name": what, "ids": ids, "skip": skip,
                                 "text": tok.decode(ids, skip_special_tokens=skip)})
    t0 = time.perf_counter()
    big_ids = tok.encode(big, add_special_tokens=False).ids
    seconds = time.perf_counter() - t0
    compared = check_transformers(path, cases, big, big_ids) if check_transformers else "-"
    print(f"{name}: vocab {tok.get_vocab_size()}, {len(cases)} strings, big.txt "
          f"{len(big.encode())} bytes -> {len(big_ids)} ids in {seconds * 1e3:.1f} ms "
          f"(tokenizers); transformers: {compared}")
    return {"file": f"{name}/tokenizer.json", "vocab_size": tok.get_vocab_size(),
            "roundtrip": name != "variant", "cases": cases, "decode": decode_cases,
            "big_ids": big_ids}


def transformers_check(cls_name, **kwargs):
    def check(path, cases, big, big_ids):
        try:
            import transformers
            cls = getattr(transformers, cls_name)
            hf = cls(tokenizer_file=path, **kwargs)
        except Exception as e:  # noqa: BLE001 - report, the tokenizers goldens still hold
            return f"could not build {cls_name}: {e}"
        for c in cases:
            got = hf(c["text"], add_special_tokens=False)["input_ids"]
            got_special = hf(c["text"], add_special_tokens=True)["input_ids"]
            got_split = hf(c["text"], add_special_tokens=False,
                           split_special_tokens=True)["input_ids"]
            dec = hf.decode(c["ids"], skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
            if got_split != c["ids_split"]:
                sys.exit(f"{cls_name} with split_special_tokens disagrees with tokenizers on "
                         f"{c['text']!r}: {got_split} vs {c['ids_split']}")
            if got != c["ids"] or got_special != c["ids_special"] or dec != c["decoded"]:
                sys.exit(f"{cls_name} disagrees with tokenizers on {c['text']!r}: {got} / "
                         f"{got_special} / {dec!r} vs {c['ids']} / {c['ids_special']} / "
                         f"{c['decoded']!r}")
        if hf(big, add_special_tokens=False)["input_ids"] != big_ids:
            sys.exit(f"{cls_name} disagrees with tokenizers on big.txt")
        return f"{cls_name} {transformers.__version__} agrees"
    return check


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    big = big_text()
    with open(os.path.join(out_dir, "big.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(big)
    neox = make_neox()
    out = {
        "qwen2": golden("qwen2", make_qwen2(), out_dir, big,
                        transformers_check("Qwen2TokenizerFast")),
        "neox": golden("neox", neox, out_dir, big,
                       transformers_check("GPTNeoXTokenizerFast", add_eos_token=True)),
        "variant": golden("variant", make_variant(neox), out_dir, big, None),
    }
    for name, g in out.items():
        if g["roundtrip"]:
            for c in g["cases"]:
                assert c["decoded"] == c["normalized"], (name, c["text"], c["decoded"])
        assert unicodedata.is_normalized("NFC", g["cases"][0]["normalized"])
    with open(os.path.join(out_dir, "golden.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
