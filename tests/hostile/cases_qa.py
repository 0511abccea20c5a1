"""Hostile input to `lvx qa`: batch outputs of other settings or torn by a kill, questions files
that are not files or whose rows are too deep or too long for the model, generation flags out of
range, and generation that would run past the model's context."""
import json
import os
import subprocess

from harness import Case


def questions(ctx, rows, name="q.jsonl"):
    return ctx.write(name, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                                   for r in rows))


def qa(ctx, *flags, model=None):
    return ["qa", "--model", model or ctx.mplug(), "--max-new-tokens", "2"] + list(flags)


def two_questions(ctx):
    return questions(ctx, [{"id": "a", "video": ctx.clip(), "question": "What colour?"},
                           {"id": "b", "video": ctx.clip(), "question": "What shape?"}])


def answered(ctx, *flags):
    """A finished batch (two answered rows) in answers.jsonl, as an earlier run left it."""
    q = two_questions(ctx)
    out = ctx.path("answers.jsonl")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([ctx.lvx] + qa(ctx, "--questions", q, "--output", out) + list(flags),
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                   cwd=ctx.dir, timeout=120)
    return q, out


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def small_context(ctx, n=64):
    """The tiny model with a context of n tokens (config.json max_position_embeddings)."""
    d = ctx.copy_model(ctx.mplug())
    cfg = os.path.join(d, "config.json")
    with open(cfg) as f:
        c = json.load(f)
    c["max_position_embeddings"] = n
    with open(cfg, "w") as f:
        json.dump(c, f)
    return d


# ---- batch output written with other settings -------------------------------------------

def rerun_other_frames(ctx):
    q, out = answered(ctx, "--num-frames", "2")
    ctx.before = open(out).read()
    return qa(ctx, "--questions", q, "--output", out, "--num-frames", "3")


def output_unchanged(ctx, res):
    assert open(ctx.path("answers.jsonl")).read() == ctx.before, "the answers changed"


def rerun_overwrite(ctx):
    q, out = answered(ctx, "--num-frames", "2")
    ctx.before = open(out).read()
    return qa(ctx, "--questions", q, "--output", out, "--num-frames", "3", "--overwrite")


def overwritten(ctx, res):
    out = ctx.path("answers.jsonl")
    assert open(out + ".old").read() == ctx.before, "the old answers were not kept in .old"
    new = rows(out)
    assert [r["id"] for r in new] == ["a", "b"], new
    assert all(r["frames"] == 3 for r in new), new


def rerun_same(ctx):
    q, out = answered(ctx, "--num-frames", "2")
    ctx.before = open(out).read()
    return qa(ctx, "--questions", q, "--output", out, "--num-frames", "2")


# ---- torn last line ----------------------------------------------------------------------

FRAGMENT = '{"id": "b", "video": "x.mp4", "respo'


def rerun_torn(ctx):
    q, out = answered(ctx, "--num-frames", "2")
    kept = [json.dumps(r) for r in rows(out) if r["id"] == "a"]
    with open(out, "w") as f:
        f.write("\n".join(kept) + "\n" + FRAGMENT)  # killed while writing row b
    return qa(ctx, "--questions", q, "--output", out, "--num-frames", "2")


def repaired(ctx, res):
    out = ctx.path("answers.jsonl")
    got = rows(out)  # every line parses
    assert sorted(r["id"] for r in got) == ["a", "b"], got
    assert open(out + ".torn").read() == FRAGMENT + "\n", "the fragment was not kept in .torn"


# ---- questions rows ----------------------------------------------------------------------

def deep_row(ctx):
    q = questions(ctx, ["[" * 100000 + "]" * 100000])
    return qa(ctx, "--questions", q, "--output", ctx.path("answers.jsonl"))


def deep_row_is_a_row_error(ctx, res):
    got = rows(ctx.path("answers.jsonl"))
    assert len(got) == 1 and "nested deeper than 64" in got[0]["error"], got


def long_question(ctx):
    m = small_context(ctx)
    q = questions(ctx, [{"id": "long", "video": ctx.clip(), "question": "colour " * 400},
                        {"id": "short", "video": ctx.clip(), "question": "What?"}])
    return qa(ctx, "--questions", q, "--output", ctx.path("answers.jsonl"), "--num-frames", "2",
              model=m)


def long_question_is_a_row_error(ctx, res):
    got = {r["id"]: r for r in rows(ctx.path("answers.jsonl"))}
    assert "more than the model's context of 64" in got["long"]["error"], got["long"]
    assert "response" in got["short"], got["short"]


def generate_past_context(ctx):
    m = small_context(ctx)
    return qa(ctx, "--video", ctx.clip(), "--question", "What?", "--num-frames", "2", "--json",
              "--max-new-tokens", "1000000000", "--ignore-stop", model=m)


def long_question_answered(ctx, res):
    row = json.loads(res.stdout)
    assert row["prompt_tokens"] > 16000, row["prompt_tokens"]
    assert row["new_tokens"] == 2, row


def stopped_at_context(ctx, res):
    row = json.loads(res.stdout)
    assert row["prompt_tokens"] + row["new_tokens"] == 64, row
    assert row["stopped_at_context"] == 64, row


CASES = [
    Case("batch_other_settings_refused", rerun_other_frames,
         stderr=r"answers\.jsonl' was written with other settings .*num_frames 2 there, 3 now.*"
                r"--overwrite",
         check=output_unchanged, timeout=180),
    Case("batch_other_settings_overwrite", rerun_overwrite, rc=0,
         stderr=r"previous answers moved to .*answers\.jsonl\.old", check=overwritten,
         timeout=180),
    Case("batch_same_settings_continues", rerun_same, rc=0, stderr=r"already in .* 2",
         check=output_unchanged, timeout=180),
    Case("batch_torn_last_line_repaired", rerun_torn, rc=0,
         stderr=r"last line was torn .* moved to .*answers\.jsonl\.torn", check=repaired,
         timeout=180),
    Case("questions_row_nested_100k_deep", deep_row, rc=0, stderr=r"nested deeper than 64",
         check=deep_row_is_a_row_error, timeout=120),
    Case("question_longer_than_context", long_question, rc=0,
         stderr=r"more than the model's context of 64", check=long_question_is_a_row_error,
         timeout=120),
    Case("single_question_longer_than_context",
         lambda c: qa(c, "--video", c.clip(), "--question", "colour " * 400, "--num-frames", "2",
                      model=small_context(c)),
         stderr=r"more than the model's context of 64", timeout=120),
    # A question of 16k tokens is extended after the video's prefill blockwise: memory linear in
    # its length (it was a whole [heads, L, L] score matrix: 9.9 GB at 14k tokens).
    Case("question_of_16k_tokens_in_bounded_memory",
         lambda c: qa(c, "--video", c.clip(), "--question", "What colour? " * 1480, "--num-frames",
                      "2", "--json", "--ignore-stop"),
         rc=0, max_rss_mb=1024, check=long_question_answered, timeout=300),
    Case("generation_stops_at_context", generate_past_context, rc=0,
         stderr=r"context of 64 tokens is full", check=stopped_at_context, timeout=180),
    Case("questions_is_a_directory",
         lambda c: qa(c, "--questions", c.dir, "--output", c.path("answers.jsonl")),
         stderr=r"questions file \(--questions\) '.*' is a directory"),
    Case("questions_is_a_fifo",
         lambda c: qa(c, "--questions", c.fifo("q.jsonl"), "--output", c.path("answers.jsonl")),
         stderr=r"questions file \(--questions\) '.*' is a FIFO", timeout=30),
    Case("output_is_a_fifo",
         lambda c: qa(c, "--questions", two_questions(c), "--output", c.fifo("answers.jsonl")),
         stderr=r"answers file \(--output\) '.*' is a FIFO", timeout=30),
    Case("output_is_a_directory",
         lambda c: qa(c, "--questions", two_questions(c), "--output", c.dir),
         stderr=r"answers file \(--output\) '.*' is a directory"),
    Case("video_is_a_fifo",
         lambda c: qa(c, "--video", c.fifo("v.mp4"), "--question", "What?"),
         stderr=r"video \(--video\) '.*v\.mp4' is a FIFO", timeout=30),
    Case("model_config_is_a_fifo",
         lambda c: qa(c, "--video", c.clip(), "--question", "What?",
                      model=fifo_config(c)),
         stderr=r"model config '.*config\.json' is a FIFO", timeout=30),
    Case("temperature_inf", lambda c: qa(c, "--video", c.clip(), "--question", "Q",
                                         "--temperature", "inf"),
         stderr=r"--temperature expects a finite number, got 'inf'"),
    Case("temperature_negative", lambda c: qa(c, "--video", c.clip(), "--question", "Q",
                                              "--temperature", "-1"),
         stderr=r"--temperature must be a finite number >= 0"),
    Case("top_p_out_of_range", lambda c: qa(c, "--video", c.clip(), "--question", "Q",
                                            "--temperature", "1", "--top-p", "1.5"),
         stderr=r"--top-p must be in \(0, 1\], got 1\.5"),
    Case("options_past_z", lambda c: qa(c, "--video", c.clip(), "--question", "Q", "--options",
                                        "|".join("o%d" % i for i in range(27))),
         stderr=r"--options needs 2 to 26 .* got 27"),
    Case("nproc_1000", lambda c: qa(c, "--video", c.clip(), "--question", "Q", "--nproc", "1000"),
         stderr=r"--nproc 1000 is more than 4 ranks per core"),
    Case("num_frames_1e9", lambda c: qa(c, "--video", c.clip(), "--question", "Q",
                                        "--num-frames", "1000000000"),
         stderr=r"num_frames 1000000000 is more than the range .* can give", timeout=120),
    Case("fps_1e9", lambda c: qa(c, "--video", c.clip(), "--question", "Q", "--fps", "1e9"),
         stderr=r"asks for about .* frames.*lower the fps", timeout=120),
]


def fifo_config(ctx):
    d = ctx.copy_model(ctx.mplug())
    os.remove(os.path.join(d, "config.json"))
    os.mkfifo(os.path.join(d, "config.json"))
    return d


def bad_utf8_question(ctx):
    q = ctx.write("q.jsonl", b'{"id": "bad", "video": "' + ctx.clip().encode() +
                  b'", "question": "caf\\udcff?"}\n' +
                  b'{"id": "raw", "video": "' + ctx.clip().encode() + b'", "question": "caf\xff"}\n' +
                  json.dumps({"id": "ok", "video": ctx.clip(), "question": "What?"}).encode() + b"\n")
    return qa(ctx, "--questions", q, "--output", ctx.path("answers.jsonl"), "--num-frames", "2")


def others_still_answered(ctx, res):
    got = {r["id"]: r for r in rows(ctx.path("answers.jsonl"))}
    assert "response" in got["ok"], got
    assert all("error" in got[k] for k in got if k != "ok"), got


CASES += [
    Case("question_not_utf8_is_a_row_error", bad_utf8_question, rc=0, stderr=r"answered 1, failed 2",
         check=others_still_answered, timeout=120),
]


def fifo_weights(ctx):
    d = ctx.copy_model(ctx.mplug())
    os.remove(os.path.join(d, "model.safetensors"))
    os.mkfifo(os.path.join(d, "model.safetensors"))
    return d


CASES += [
    Case("model_weights_are_a_fifo",
         lambda c: qa(c, "--video", c.clip(), "--question", "What?", model=fifo_weights(c)),
         stderr=r"model file '.*model\.safetensors' is a FIFO", timeout=30),
]
