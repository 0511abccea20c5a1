"""The hostile-input suite's harness: every case makes its files, runs one lvx command and asserts
how it ends.

A case names the command (argv after `lvx`, built from a Ctx), the exit code it must end with (1
unless said otherwise), a regular expression that stderr must match (the named error), a time
bound (a hang fails the case; the process group is killed) and a memory bound (peak RSS of the
command and the ranks it started, from wait4's rusage), plus an optional `check(ctx, result)` for
what must not be lost (a file that must stay unchanged, an output that must not grow).

Cases live in tests/hostile/cases_<area>.py as `CASES = [Case(...), ...]`; one CTest per area
(`hostile_<area>`). `python run.py AREA [-k SUBSTRING] [--list]`; LVX_BIN names the binary.
Ends with the plain summary line "N passed, N failed".
"""
import dataclasses
import hashlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Union

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent.parent
REFERENCE = SOURCE / "tests" / "reference"


@dataclasses.dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    max_rss_mb: float
    timed_out: bool


@dataclasses.dataclass
class Case:
    name: str
    argv: Union[Sequence[str], Callable[["Ctx"], Sequence[str]]]
    stderr: str = ""                 # regex that stderr must match (re.S | re.I)
    rc: int = 1                      # expected exit code
    timeout: float = 60.0            # seconds; past it the case fails as a hang
    max_rss_mb: float = 2048.0       # peak RSS of the command and its ranks
    check: Optional[Callable[["Ctx", Result], None]] = None
    stdin: Optional[str] = None
    env: Optional[dict] = None
    faults: bool = False             # run lvx-faults (LVX_FAULT_* act), lvx's sibling


class Ctx:
    """Per-case working folder plus shared, lazily made fixtures (tiny models, a clip)."""

    _shared: dict = {}

    def __init__(self, root: Path, case_dir: Path):
        self.root = root              # shared across the area's cases
        self.dir = case_dir           # this case's own folder
        self.lvx = os.path.abspath(os.environ.get("LVX_BIN", str(SOURCE / "build" / "lvx")))
        self.python = sys.executable

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def write(self, name: str, data: Union[str, bytes]) -> str:
        p = self.dir / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return str(p)

    def fifo(self, name: str) -> str:
        p = self.dir / name
        os.mkfifo(p)
        return str(p)

    def _fixture(self, key: str, make: Callable[[Path], None], sources: Sequence[Path] = (),
                 args: Sequence[str] = ()) -> Path:
        """A fixture made once per run, or, when it is a generator's output (`sources`: the
        scripts that make it, `args`: their arguments), once per generator version in the
        test-reference cache that the C++ tests use too (cached_fixture)."""
        if key not in Ctx._shared:
            cached = cached_fixture(key, sources, args) if sources else None
            p = cached or self.root / "fixtures" / key
            if not p.exists():
                tmp = Path("%s.tmp.%d" % (p, os.getpid()))
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                make(tmp)
                try:
                    tmp.rename(p)
                except OSError:  # another suite made it meanwhile
                    shutil.rmtree(tmp, ignore_errors=True)
            Ctx._shared[key] = p
        return Ctx._shared[key]

    def mplug(self, variant: str = "240728") -> str:
        """A tiny random mPLUG-Owl3 checkpoint (tests/reference/mplug_owl3_ref.py make-model)."""
        script = REFERENCE / "mplug_owl3_ref.py"

        def make(d: Path):
            subprocess.run([self.python, str(script), "make-model", str(d), "--variant", variant],
                           check=True, stdout=subprocess.DEVNULL)
        return str(self._fixture("mplug_" + variant, make, [script], ["make-model", variant]))

    def flamingo(self, lm: str = "mpt") -> str:
        """A tiny random OpenFlamingo checkpoint (tests/reference/openflamingo_ref.py)."""
        script = REFERENCE / "openflamingo_ref.py"

        def make(d: Path):
            subprocess.run([self.python, str(script), "make-model", str(d), "--lm", lm],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return str(self._fixture("flamingo_" + lm, make,
                                 [script, SOURCE / "models/openflamingo/convert_openflamingo.py"],
                                 ["make-model", lm]))

    def copy_model(self, src: str, name: str = "model") -> str:
        dst = self.dir / name
        shutil.copytree(src, dst)
        return str(dst)

    def clip(self, seconds: int = 4) -> str:
        """A small test video (ffmpeg's testsrc, 64x48, 4 fps)."""
        def make(d: Path):
            subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "lavfi", "-i",
                            "testsrc=size=64x48:rate=4", "-t", str(seconds), "-pix_fmt",
                            "yuv420p", str(d / "clip.mp4")], check=True)
        return str(self._fixture("clip%d" % seconds, make) / "clip.mp4")


def cached_fixture(key: str, sources: Sequence[Path], args: Sequence[str]) -> Optional[Path]:
    """Where a generated fixture lives across runs: LVX_TEST_CACHE, else
    $XDG_CACHE_HOME/lvx/test-references, else ~/.cache/lvx/test-references (as the C++ tests'
    generated()), in a folder named after it and the hash of its generators' sources, the pinned
    packages and its arguments; None with LVX_TEST_CACHE=off (then: this run's own folder)."""
    v = os.environ.get("LVX_TEST_CACHE", "")
    if v in ("off", "0", "none"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ.get("HOME", "/tmp"),
                                                             ".cache")
    root = Path(v) if v else Path(base) / "lvx" / "test-references"
    h = hashlib.sha256()
    for f in list(sources) + [SOURCE / "requirements.txt", SOURCE / "requirements-nodeps.txt"]:
        h.update(Path(f).read_bytes())
    h.update("\0".join(args).encode())
    root.mkdir(parents=True, exist_ok=True)
    return root / ("hostile_%s-%s" % (key, h.hexdigest()[:16]))


def _case_env(case: Case) -> dict:
    """The environment a case's command runs with: ours, bounded timeouts, one thread, case.env."""
    env = dict(os.environ)
    env.setdefault("LVX_DIST_TIMEOUT_S", "20")
    env["OMP_NUM_THREADS"] = "1"
    if case.env:
        env.update(case.env)
    return env


def _limits():
    """preexec_fn: a process group of its own and an address-space cap."""
    os.setsid()
    # Address space cap: a case that tries to allocate without bound fails here rather than
    # taking the machine down (libtorch maps several GiB of libraries it never touches).
    cap = 16 << 30
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def _start(case: Case, cmd: List[str], case_dir: Path, env: dict) -> subprocess.Popen:
    """Starts the command in case_dir (stdout/stderr to files there) and feeds it case.stdin."""
    p = subprocess.Popen(cmd, cwd=case_dir, env=env, preexec_fn=_limits,
                         stdin=subprocess.PIPE if case.stdin is not None else subprocess.DEVNULL,
                         stdout=open(case_dir / "stdout", "wb"), stderr=open(case_dir / "stderr", "wb"))
    if case.stdin is not None:
        try:
            p.stdin.write(case.stdin.encode())
            p.stdin.close()
        except BrokenPipeError:
            pass
    return p


def _wait(p: subprocess.Popen, deadline: float):
    """Waits for p until deadline (then kills its group): (timed_out, wait status, rusage)."""
    timed_out = False
    status, usage = 0, None
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            timed_out = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status, usage = os.wait4(p.pid, 0)
            break
        time.sleep(0.02)
    p.returncode = 0
    return timed_out, status, usage


def _kill_strays(pgid: int) -> bool:
    """Kills what is left of process group pgid; whether anything was."""
    # Ranks left behind by a failing command are a defect too: they would hold ports and memory.
    try:
        os.killpg(pgid, 0)
        os.killpg(pgid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _problems(case: Case, ctx: Ctx, res: Result, stray: bool) -> List[str]:
    """Every way the finished command missed what the case asks (then case.check, if none)."""
    problems = []
    if res.timed_out:
        problems.append("hung: killed after %.0f s" % case.timeout)
    if res.rc != case.rc:
        problems.append("exit code %d, expected %d" % (res.rc, case.rc))
    if case.stderr and not re.search(case.stderr, res.stderr, re.S | re.I):
        problems.append("stderr does not match /%s/" % case.stderr)
    if case.rc != 0 and not res.stderr.strip():
        problems.append("failed with nothing on stderr")
    if re.search(r"terminate called|Segmentation fault|core dumped|Floating point exception|"
                 r"AddressSanitizer|internal error|c10::Error", res.stderr):
        problems.append("crash text on stderr")
    if res.max_rss_mb > case.max_rss_mb:
        problems.append("peak RSS %.0f MiB > %.0f MiB" % (res.max_rss_mb, case.max_rss_mb))
    if stray:
        problems.append("left processes running")
    if case.check and not problems:
        try:
            case.check(ctx, res)
        except AssertionError as e:
            problems.append("check: %s" % e)
    return problems


def run_case(case: Case, root: Path) -> (bool, str):
    """Runs one case in its own folder under root: (passed, one-line detail or the problems)."""
    case_dir = root / "cases" / re.sub(r"[^A-Za-z0-9_.-]", "_", case.name)
    shutil.rmtree(case_dir, ignore_errors=True)
    case_dir.mkdir(parents=True)
    ctx = Ctx(root, case_dir)
    argv = case.argv(ctx) if callable(case.argv) else list(case.argv)
    lvx = os.path.join(os.path.dirname(ctx.lvx), "lvx-faults") if case.faults else ctx.lvx
    cmd = [lvx] + [str(a) for a in argv]
    env = _case_env(case)

    t0 = time.monotonic()
    p = _start(case, cmd, case_dir, env)
    timed_out, status, usage = _wait(p, t0 + case.timeout)
    seconds = time.monotonic() - t0
    stray = _kill_strays(p.pid)
    rc = os.waitstatus_to_exitcode(status)
    if rc < 0:
        rc = 128 - rc
    res = Result(rc, (case_dir / "stdout").read_text(errors="replace"),
                 (case_dir / "stderr").read_text(errors="replace"), seconds,
                 usage.ru_maxrss / 1024.0, timed_out)
    problems = _problems(case, ctx, res, stray)
    detail = "%.1f s, %.0f MiB, rc %d" % (res.seconds, res.max_rss_mb, res.rc)
    if problems:
        tail = res.stderr.strip().splitlines()[-6:]
        return False, "%s (%s)\n      cmd: %s\n      stderr: %s" % (
            "; ".join(problems), detail, " ".join(cmd), "\n              ".join(tail))
    first = res.stderr.strip().splitlines()
    return True, "%s: %s" % (detail, first[-1][:160] if first else "")


def main(argv: List[str]) -> int:
    import argparse
    import importlib
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("area")
    ap.add_argument("-k", default="", help="run cases whose name contains this")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--workdir", default="")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    cases = importlib.import_module("cases_" + a.area).CASES
    names = [c.name for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, "duplicate case names: %s" % sorted(dup)
    cases = [c for c in cases if a.k in c.name]
    if a.list:
        for c in cases:
            print(c.name)
        return 0
    root = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="lvx_hostile_" + a.area + "_"))
    root.mkdir(parents=True, exist_ok=True)
    passed = failed = 0
    for c in cases:
        try:
            ok, msg = run_case(c, root)
        except Exception as e:  # a fixture that could not be made fails its case, not the run
            ok, msg = False, "harness: %r" % (e,)
        print("%s %s: %s" % ("PASS" if ok else "FAIL", c.name, msg), flush=True)
        passed += ok
        failed += not ok
    if not a.workdir and failed == 0:
        shutil.rmtree(root, ignore_errors=True)
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed or not cases else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ---- file builders shared by the areas -----------------------------------------------------

def safetensors_bytes(tensors=None, header=None, data=b"", header_len=None, pad=True) -> bytes:
    """A safetensors file. `tensors`: {name: (dtype, shape, bytes)} laid out in order; or a raw
    `header` dict (written as given, for malformed files) with `data`. `header_len` overrides the
    8-byte length prefix (a lie about the header's size)."""
    import json
    import struct
    if tensors is not None:
        header, data, off = {}, b"", 0
        for name, (dtype, shape, raw) in tensors.items():
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
            data += raw
            off += len(raw)
    text = json.dumps(header).encode() if isinstance(header, dict) else header
    if pad and len(text) % 8:
        text += b" " * (8 - len(text) % 8)
    n = len(text) if header_len is None else header_len
    return struct.pack("<Q", n) + text + data


def f32(*values) -> bytes:
    import struct
    return struct.pack("<%df" % len(values), *values)
