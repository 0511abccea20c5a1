"""lmms-eval 0.7.3 itself against `lvx serve`: a local multiple-choice video QA task (JSONL rows,
no hub; benchmarks/lmms_eval_task) run through lmms-eval's `openai` chat model, in both of its
ways of sending a video, against `lvx qa` on the same rows.

  python bench_lmms_eval.py [--rows 12] [--frames 8] [--nproc 1]
                            [--lmms-python ~/.cache/lvx/lmms-venv/bin/python] [-o md|json]

lmms-eval runs in its own virtual environment (--lmms-python; made by
`python3 -m venv ~/.cache/lvx/lmms-venv`, `pip install lmms-eval==0.7.3 "filelock<4" decord`; a .pth
file may share torch and transformers of lvx's environment instead of downloading them again;
lmms-eval 0.7.3 imports filelock._api, which filelock 4 removed; its video reader, qwen_vl_utils,
falls back to torchvision.io.read_video, which torchvision 0.26 removed, unless decord is there).
  - pass_video_url=True: lmms-eval sends the video's file:// URL and vLLM's
    media_io_kwargs.video.num_frames = max_frames_num; lvx serve samples those frames as
    `lvx qa --num-frames` does, so every row's answer must equal lvx qa's (checked: the run stops
    otherwise), and the accuracies are equal.
  - default (image_url frames): lmms-eval decodes max_frames_num frames itself (qwen_vl_utils:
    its own sampling and resizing) and sends them as PNGs; lvx serve answers those frames, so
    answers may differ from lvx qa's (different pixels). Reported side by side.
Model: the tiny random mPLUG-Owl3 of bench_serve.py (its accuracy is chance-level or below: the
point is the harness end to end and the agreement, not the score). Videos: ffmpeg test patterns.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from serve_setup import SOURCE, bench_paths, start_serve

SOURCES = ["testsrc2", "smptebars", "rgbtestsrc", "testsrc", "mandelbrot", "cellauto"]


def make_rows(media, n):
    rows = []
    for i in range(n):
        src = SOURCES[i % len(SOURCES)]
        video = media / ("lmms_%s.mp4" % src)
        if not video.exists():
            subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-f", "lavfi", "-i",
                            "%s=size=64x48:rate=4" % src, "-t", "6", "-pix_fmt", "yuv420p",
                            str(video)], check=True)
        rows.append({"id": "q%d" % i, "video": str(video),
                     "question": ["What pattern is shown?", "Which colours appear first?",
                                  "Does the picture move?"][i % 3],
                     "options": ["Bars", "A gradient", "Noise", "Text"],
                     "answer": "ABCD"[i % 4]})
    return rows


class Server:
    def __init__(self, lvx, model, media, nproc):
        self.proc, self.port = start_serve(
            [lvx, "serve", "--model", model, "--nproc", str(nproc), "--port", "0",
             "--allowed-local-media-path", media, "--served-model-name", "lvx-tiny",
             "--max-new-tokens", "8"])

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=120)


def run_lmms(a, srv, task_dir, out, frames, pass_video_url, rows):
    args = "model_version=lvx-tiny,max_frames_num=%d,timeout=300,num_concurrent=8" % frames
    if pass_video_url:
        args += ",pass_video_url=True"
    env = dict(os.environ, OPENAI_API_BASE="http://127.0.0.1:%d/v1" % srv.port,
               OPENAI_API_KEY="none", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    p = subprocess.run([a.lmms_python, "-m", "lmms_eval", "--model", "openai", "--model_args", args,
                        "--tasks", "lvx_videoqa", "--include_path", str(task_dir),
                        "--batch_size", "1", "--output_path", str(out), "--log_samples"],
                       env=env, capture_output=True, text=True, timeout=1800)
    wall = time.time() - t0
    samples = {}
    for f in out.rglob("*_samples_lvx_videoqa.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            resp = s["filtered_resps"]
            resp = resp[0] if isinstance(resp, list) else resp
            samples[rows[s["doc_id"]]["id"]] = {"response": resp, "accuracy": s["accuracy"]}
    # lmms-eval logs an error during evaluation and still exits 0: no samples is the failure.
    if p.returncode != 0 or not samples:
        sys.exit("lmms-eval failed:\n" + p.stdout[-3000:] + p.stderr[-6000:])
    return samples, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--lmms-python",
                    default=os.path.expanduser("~/.cache/lvx/lmms-venv/bin/python"))
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "lvx_bench_serve"))
    ap.add_argument("-o", "--output", default="md", choices=["md", "json"])
    a = ap.parse_args()
    lvx, work, media, model = bench_paths(a.workdir)
    rows = make_rows(media, a.rows)
    run = work / "lmms_eval"
    shutil.rmtree(run, ignore_errors=True)
    (run / "task").mkdir(parents=True)
    rows_path = run / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = (SOURCE / "benchmarks/lmms_eval_task/lvx_videoqa.yaml").read_text()
    (run / "task/lvx_videoqa.yaml").write_text(template.replace("@ROWS@", str(rows_path)))
    shutil.copy(SOURCE / "benchmarks/lmms_eval_task/utils.py", run / "task/utils.py")
    # lvx qa on the same rows and frames: the reference answers.
    subprocess.run([lvx, "qa", "--model", str(model), "--questions", str(rows_path), "--output",
                    str(run / "qa.jsonl"), "--num-frames", str(a.frames), "--max-new-tokens", "8",
                    "--nproc", str(a.nproc)], check=True, capture_output=True)
    qa = {r["id"]: r for r in map(json.loads, (run / "qa.jsonl").read_text().splitlines())}
    qa_acc = sum(1.0 for r in qa.values() if r.get("correct")) / len(qa)
    srv = Server(lvx, str(model), str(media), a.nproc)
    results = []
    try:
        for mode, pass_url in (("pass_video_url=True", True), ("image_url frames (default)", False)):
            samples, wall = run_lmms(a, srv, run / "task", run / ("out_" + str(pass_url)),
                                     a.frames, pass_url, rows)
            assert len(samples) == len(rows), ("lmms-eval scored %d of %d rows" %
                                               (len(samples), len(rows)))
            same = sum(samples[i]["response"] == qa[i]["response"] for i in qa)
            if pass_url:
                for i in qa:
                    assert samples[i]["response"] == qa[i]["response"], (
                        "row %s: lmms-eval got %r, lvx qa %r" % (i, samples[i]["response"],
                                                                qa[i]["response"]))
            acc = sum(s["accuracy"] for s in samples.values()) / len(samples)
            results.append({"mode": mode, "rows": len(samples), "accuracy": acc,
                            "qa_accuracy": qa_acc, "answers_equal_qa": same, "wall_s": wall})
    finally:
        srv.stop()
    if a.output == "json":
        print(json.dumps(results))
        return
    print("| lmms-eval sends | rows | lmms-eval accuracy | lvx qa accuracy | answers equal to lvx qa "
          "| wall s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print("| %s | %d | %.3f | %.3f | %d of %d | %.1f |" % (
            r["mode"], r["rows"], r["accuracy"], r["qa_accuracy"], r["answers_equal_qa"],
            r["rows"], r["wall_s"]))


if __name__ == "__main__":
    main()
