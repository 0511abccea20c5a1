"""Hostile inputs and slips of `lvx finetune` (docs/finetune.md): divergence, metrics files of
other runs, --resume with a changed config or a damaged trainer state, a deleted `latest`
pointer, a failure on one rank, a slow checkpoint write, unbounded counts and oversized rows.

Each case makes a tiny run in its folder (the tiny mPLUG-Owl3, a 4-second clip, 2 frames per
sample); cases about resuming first train a good checkpoint with a setup run and check that it
is still `latest` and unchanged afterwards."""
import hashlib
import json
import os
import subprocess
from pathlib import Path

from harness import Case


def rows(ctx, n=2, answer="color bars"):
    clip = ctx.clip()
    text = "".join(json.dumps({"id": "q%d" % i, "video": clip, "question": "What is shown?",
                               "answer": answer}) + "\n" for i in range(n))
    return ctx.write("train.jsonl", text)


def config(ctx, steps=2, every=1, nproc=1, data=None, extra=""):
    """A run config in the case's folder; checkpoints in ck/ (metrics: ck/metrics.jsonl)."""
    text = ("model: {path: %s}\n" % ctx.mplug() +
            "data: {train: %s, num_frames: 2, seed: 1}\n" % (data or rows(ctx)) +
            "optimizer: {lr: 1.0e-3, grad_clip: 1.0}\n"
            "schedule: {steps: %d, warmup_steps: 1}\n" % steps +
            "checkpoint: {dir: %s, every: %d, keep: 3}\n" % (ctx.path("ck"), every) +
            "parallel: {nproc: %d, strategies: \"lv_xattn,ring\"}\n" % nproc + extra)
    return ctx.write("run.yaml", text)


def setup_run(ctx, cfg, *args):
    """Trains the good checkpoint a case starts from (fails the case if it does not succeed)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([ctx.lvx, "finetune", "--config", cfg] + list(args), cwd=ctx.dir, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    assert p.returncode == 0, "setup run failed: " + p.stderr.decode(errors="replace")[-2000:]


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def snapshot(ctx):
    """Hashes of every file under ck/ (what must not change), kept in the case's folder."""
    ck = Path(ctx.path("ck"))
    files = {str(p.relative_to(ck)): digest(p) for p in sorted(ck.rglob("*")) if p.is_file()}
    Path(ctx.path("ck.snapshot.json")).write_text(json.dumps(files))
    return files


def unchanged(ctx, res):
    before = json.loads(Path(ctx.path("ck.snapshot.json")).read_text())
    ck = Path(ctx.path("ck"))
    now = {str(p.relative_to(ck)): digest(p) for p in sorted(ck.rglob("*")) if p.is_file()}
    assert now == before, "checkpoint.dir changed: %s" % sorted(
        set(now.items()) ^ set(before.items()))


def trained(ctx, steps=2, **kw):
    """A config and a finished good run of `steps` steps (checkpoint every step)."""
    cfg = config(ctx, steps=steps, **kw)
    setup_run(ctx, cfg)
    snapshot(ctx)
    return cfg


def edit_state(ctx, fn):
    """Edits the latest checkpoint's trainer_state.json and drops it from the manifest (a state
    written by hand, or by another tool: only its own checks stand between it and the run)."""
    ck = Path(ctx.path("ck"))
    step = ck / (ck / "latest").read_text().strip()
    st = json.loads((step / "trainer_state.json").read_text())
    fn(st)
    (step / "trainer_state.json").write_text(json.dumps(st))
    m = json.loads((step / "manifest.json").read_text())
    del m["files"]["trainer_state.json"]
    (step / "manifest.json").write_text(json.dumps(m))


def on_rank(regex, then=None):
    """For errors a rank finds while training: `lvx launch` forwards each rank's stderr to its
    own stderr (prefixed), so the named error must be there and not on stdout."""
    import re

    def check(ctx, res):
        assert re.search(regex, res.stderr, re.S | re.I), "no /%s/ on stderr" % regex
        assert not re.search(regex, res.stdout, re.S | re.I), "/%s/ on stdout" % regex
        if then:
            then(ctx, res)
    return check


RANK_FAILED = r"error:|exited with code 1"


# ---- divergence ------------------------------------------------------------------------------

def resume_diverging(*overrides):
    def argv(ctx):
        cfg = trained(ctx, steps=2)
        snapshot(ctx)
        return ["finetune", "--config", cfg, "--resume", "--accept-config-changes",
                "schedule.steps=5"] + list(overrides)
    return argv


def still_latest_step2(ctx, res):
    ck = Path(ctx.path("ck"))
    assert (ck / "latest").read_text().strip() == "step-000002", "latest moved"
    assert not any(p.name.startswith("step-00000") and p.name > "step-000002"
                   for p in ck.iterdir() if not p.name.endswith(".partial")), "a later checkpoint"


def diverged_metrics_bounded(ctx, res):
    still_latest_step2(ctx, res)
    ck = Path(ctx.path("ck"))
    for line in (ck / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        assert m["loss"] == m["loss"] and abs(m["loss"]) != float("inf"), "a non-finite loss row"


def fresh_diverging(ctx):
    return ["finetune", "--config", config(ctx, steps=3), "optimizer.eps=0"]


def nothing_saved(ctx, res):
    ck = Path(ctx.path("ck"))
    assert not (ck / "latest").exists(), "a checkpoint of a diverged run was written"


# ---- metrics ---------------------------------------------------------------------------------

def other_runs_metrics(ctx):
    other = ctx.write("other/metrics.jsonl", "".join(
        json.dumps({"step": i + 1, "loss": 1.0}) + "\n" for i in range(100)))
    ctx.write("other.sha", digest(other))
    return ["finetune", "--config", config(ctx), "logging.metrics=" + other]


def other_metrics_kept(ctx, res):
    other = ctx.path("other/metrics.jsonl")
    assert digest(other) == Path(ctx.path("other.sha")).read_text(), "another run's metrics changed"
    assert not Path(ctx.path("ck/latest")).exists(), "the run started"


def copied_run_folder(ctx):
    import shutil
    cfg = trained(ctx)
    shutil.copytree(ctx.path("ck"), ctx.path("ck2"))
    return ["finetune", "--config", cfg, "--resume", "--accept-config-changes",
            "checkpoint.dir=" + ctx.path("ck2"), "schedule.steps=3"]


def copy_continued(ctx, res):
    unchanged(ctx, res)  # the original run folder
    lines = Path(ctx.path("ck2/metrics.jsonl")).read_text().splitlines()
    assert [json.loads(l)["step"] for l in lines] == [1, 2, 3], lines


# ---- resume ----------------------------------------------------------------------------------

def resume_changed(ctx):
    cfg = trained(ctx)
    return ["finetune", "--config", cfg, "--resume", "schedule.steps=4", "optimizer.lr=1e-2",
            "data.seed=7"]


def resume_accepted(ctx):
    cfg = trained(ctx)
    return ["finetune", "--config", cfg, "--resume", "--accept-config-changes",
            "schedule.steps=3", "optimizer.lr=5e-4"]


def accepted_ran(ctx, res):
    assert Path(ctx.path("ck/latest")).read_text().strip() == "step-000003", "did not continue"


def bad_state(fn):
    def argv(ctx):
        cfg = trained(ctx)
        edit_state(ctx, fn)
        snapshot(ctx)
        return ["finetune", "--config", cfg, "--resume", "schedule.steps=2"]
    return argv


def set_path(path, value):
    def fn(st):
        obj = st
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
    return fn


def no_latest(resume):
    def argv(ctx):
        cfg = trained(ctx)
        os.remove(ctx.path("ck/latest"))
        snapshot(ctx)
        return ["finetune", "--config", cfg] + (["--resume"] if resume else [])
    return argv


def steps_kept(ctx, res):
    unchanged(ctx, res)
    assert Path(ctx.path("ck/step-000001")).is_dir() and Path(ctx.path("ck/step-000002")).is_dir()


# ---- ranks -----------------------------------------------------------------------------------

def video_bad_on_rank1(ctx):
    """A clip whose index (moov first) and size are whole but whose last frame's data is
    overwritten with garbage: it passes the check before the run (header, duration, sizes), and
    decoding fails on the rank that holds the last sampled frame only (frames are striped across
    the ranks: of 8 sampled frames rank 1 holds positions 1, 3, 5, 7)."""
    good = ctx.path("good.mp4")
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i",
                    "testsrc=size=64x48:rate=4", "-t", "8", "-pix_fmt", "yuv420p", "-g", "1",
                    "-movflags", "+faststart", good], check=True)
    data = bytearray(Path(good).read_bytes())
    for i in range(len(data) * 985 // 1000, len(data) * 999 // 1000):
        data[i] = 0xFF
    bad = ctx.write("bad.mp4", bytes(data))
    row = json.dumps({"id": "broken", "video": bad, "question": "What is shown?",
                      "answer": "bars"})
    data_file = ctx.write("train.jsonl", row + "\n")
    return ["finetune", "--config", config(ctx, steps=1, nproc=2, data=data_file),
            "data.num_frames=8", "data.shuffle=false"]


def slow_write(ctx):
    return ["finetune", "--config", config(ctx, steps=2, nproc=2)]


def slow_write_done(ctx, res):
    assert Path(ctx.path("ck/latest")).read_text().strip() == "step-000002"


# ---- sizes -----------------------------------------------------------------------------------

def long_row(ctx):
    data = rows(ctx, n=1, answer=" ".join(["bars"] * 40000))
    return ["finetune", "--config", config(ctx, steps=1, data=data)]


def deep_row(ctx):
    data = ctx.write("deep.jsonl", "[" * 100000 + "]" * 100000 + "\n")
    return ["finetune", "--config", config(ctx, data=data)]


def huge_line(ctx):
    data = ctx.write("huge.jsonl", json.dumps({"video": ctx.clip(), "question": "q" * (2 << 20),
                                               "answer": "a"}) + "\n")
    return ["finetune", "--config", config(ctx, data=data)]


CASES = [
    # lr=1e30: step 3's update is huge but finite (saved only at step 4, which never comes);
    # step 4's loss is not finite.
    Case("diverge_lr_1e30_keeps_last_good_checkpoint",
         resume_diverging("optimizer.lr=1e30", "checkpoint.every=2"),
         stderr=RANK_FAILED, timeout=180,
         check=on_rank(r"step [345]: training diverged: .*(loss|gradient norm|non-finite).*"
                       r"stays latest", diverged_metrics_bounded)),
    Case("diverge_eps_0_saves_nothing", fresh_diverging,
         stderr=RANK_FAILED, timeout=120,
         check=on_rank(r"step 1: training diverged: the update made parameter '.*' non-finite"
                       r".*eps 0", nothing_saved)),
    Case("metrics_of_another_run_not_truncated", other_runs_metrics,
         stderr=r"logging\.metrics: .*other/metrics\.jsonl already holds \d+ bytes",
         timeout=60, check=other_metrics_kept),
    Case("resume_in_a_copied_run_folder_continues_its_metrics", copied_run_folder, rc=0,
         timeout=180, check=copy_continued),
    Case("resume_with_changed_config_names_fields", resume_changed,
         stderr=r"differs from the one step-000002 was trained with.*data\.seed: 1 -> 7.*"
                r"optimizer\.lr: 0\.001 -> 0\.01.*schedule\.steps: 2 -> 4.*--accept-config-changes",
         timeout=180, check=unchanged),
    Case("resume_accept_config_changes_continues", resume_accepted, rc=0, timeout=180,
         check=accepted_ran),
    Case("trainer_state_negative_step", bad_state(set_path(["step"], -1)),
         stderr=r"trainer_state\.json: field 'step' must be >= 1, got -1", timeout=180,
         check=unchanged),
    Case("trainer_state_step_is_a_string", bad_state(set_path(["step"], "2")),
         stderr=r"trainer_state\.json: field 'step' must be an integer, got \"2\"", timeout=180,
         check=unchanged),
    Case("trainer_state_step_other_than_folder", bad_state(set_path(["step"], 7)),
         stderr=r"trainer_state\.json: field 'step' is 7 but the checkpoint is step-000002",
         timeout=180, check=unchanged),
    Case("trainer_state_data_position_inconsistent",
         bad_state(set_path(["data", "samples_seen"], -5)),
         stderr=r"trainer_state\.json: field 'data\.samples_seen' must be >= 0, got -5",
         timeout=180, check=unchanged),
    Case("trainer_state_without_config", bad_state(lambda st: st.pop("config")),
         stderr=r"trainer_state\.json: missing field 'config'", timeout=180, check=unchanged),
    Case("latest_deleted_resume_refused", no_latest(True),
         stderr=r"holds checkpoint folders \(step-000001, step-000002\) but no 'latest' pointer",
         timeout=180, check=steps_kept),
    Case("latest_deleted_fresh_refused", no_latest(False),
         stderr=r"holds checkpoint folders \(step-000001, step-000002\) but no 'latest' pointer",
         timeout=180, check=steps_kept),
    Case("bad_video_on_one_rank_fails_every_rank_at_once", video_bad_on_rank1,
         stderr=RANK_FAILED, timeout=40, env={"LVX_DIST_TIMEOUT_S": "60"},
         check=on_rank(r"step 1, sample 'broken' \(.*train\.jsonl:1\): failed on 1 of 2 ranks"
                       r".*rank 1:")),
    Case("slow_checkpoint_write_outlasts_the_timeout", slow_write, rc=0, timeout=120,
         env={"LVX_DIST_TIMEOUT_S": "3", "LVX_FAULT_CHECKPOINT": "slow@2",
              "LVX_FAULT_SLOW_S": "6"}, faults=True, check=slow_write_done),
    Case("num_frames_unbounded", lambda ctx: ["finetune", "--config", config(ctx),
                                              "data.num_frames=1000000000"],
         stderr=r"data\.num_frames: at most 4096 frames per sample, got 1000000000", timeout=30),
    # One dtype reader (src/common/dtype.h): an unknown name is refused naming the field, never
    # read as fp32; fp16 is a known name that training refuses (no loss scaling).
    Case("model_dtype_unknown_refused", lambda ctx: ["finetune", "--config", config(ctx),
                                                     "model.dtype=float16"],
         stderr=r"model\.dtype: expected fp32, bf16 or fp16, got 'float16'", timeout=30),
    Case("model_dtype_fp16_refused", lambda ctx: ["finetune", "--config", config(ctx),
                                                  "model.dtype=fp16"],
         stderr=r"model\.dtype: fp16 is not supported for training", timeout=30),
    Case("nproc_unbounded", lambda ctx: ["finetune", "--config", config(ctx), "--nproc",
                                         "100000"],
         stderr=r"parallel\.nproc: at most 1024 local ranks, got 100000", timeout=30),
    Case("row_longer_than_context", long_row, stderr=RANK_FAILED, timeout=90,
         check=on_rank(r"sample 'q0' \(.*train\.jsonl:1\).*tokens .*more than the model's "
                       r"context of 32768")),
    Case("row_nested_too_deep", deep_row, stderr=r"deep\.jsonl' line 1: JSON nested deeper than 64",
         timeout=30),
    Case("row_longer_than_1mib", huge_line, stderr=r"huge\.jsonl' line 1: longer than 1048576 bytes",
         timeout=30),
]
