"""What the lvx serve benchmarks share (bench_serve.py, bench_serve_load.py, bench_lmms_eval.py):
the lvx binary, the work folder with its media folder and the tiny random mPLUG-Owl3 checkpoint
(tests/reference/mplug_owl3_ref.py make-model), and starting `lvx serve` on a free port."""
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent


def bench_paths(workdir):
    """(lvx binary, work folder, media folder, model folder); the model is made once."""
    lvx = os.environ.get("LVX_BIN", str(SOURCE / "build" / "lvx"))
    work = Path(workdir)
    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(SOURCE / "tests/reference/mplug_owl3_ref.py"),
                        "make-model", str(model), "--variant", "240728"], check=True,
                       stdout=subprocess.DEVNULL)
    return lvx, work, media, model


def start_serve(cmd, timeout_lines=10000):
    """Starts `cmd` (an `lvx serve ... --port 0` command line) and returns (process, port) once it
    listens; its stderr is drained in the background from then on."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    port = None
    for _ in range(timeout_lines):
        line = proc.stderr.readline()
        if not line:
            break
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    assert port, "server did not start: %s" % " ".join(cmd)
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, port
