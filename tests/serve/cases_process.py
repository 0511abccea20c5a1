"""lvx serve cases: the server's processes.

SIGTERM drains (the stream in flight completes, exit 0), a killed rank turns into 503 and a
non-zero exit, a port in use fails every rank at once, the API key is in no rank's argv, and under
an emulated cluster the printed address is the one the server listens on.
"""
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from harness import LVX, KEY, video_part, messages, ask, file_url, expect_error, descendants


def case_sigterm_finishes_in_flight(fx, srv, ranks):
    # The stream in flight completes; a request arriving during the drain gets 503 (it got 200
    # while the generation loop had not yet looked at the signal). The drain is seen to have
    # begun on /health (the launcher forwards the signal within 50 ms).
    got = {}
    first = threading.Event()

    def run():
        s = ask(srv, video_part(file_url(fx.clip)), max_tokens=300, stream=True)
        parts = []
        for c in s:
            first.set()
            parts.append(c.choices[0].delta.content or "" if c.choices else "")
        got["text"] = "".join(parts)
        got["done_at"] = time.time()

    t = threading.Thread(target=run)
    t.start()
    assert first.wait(30), "the stream sent nothing"
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 5
    while srv.http("GET", "/health", key=None)[0] != 503 and time.time() < deadline:
        time.sleep(0.01)
    status, text = srv.http("POST", "/v1/chat/completions",
                            json.dumps({"model": "model", "max_tokens": 4,
                                        "messages": messages(video_part(file_url(fx.clip)))}))
    answered_at = time.time()
    code = srv.stop(signal.SIGTERM)
    t.join(30)
    assert got.get("done_at"), "the stream in flight did not complete"
    print("  drain probe: %d, stream ended %.2f s after it" % (status, got["done_at"] - answered_at))
    assert got["done_at"] > answered_at, "the stream ended before the probe: make it longer"
    assert status == 503 and "shutting down" in text, (status, text[:300])
    assert code == 0, "exit %s\n%s" % (code, srv.stderr())


def case_killed_rank_503(fx, srv, ranks):
    # Rank 1 (a child of the launcher with RANK=1) dies: requests get 503 and the server exits
    # non-zero within LVX_DIST_TIMEOUT_S (4 s here) plus its heartbeat.
    kids = subprocess.run(["pgrep", "-P", str(srv.proc.pid)], capture_output=True,
                          text=True).stdout.split()
    victim = None
    for pid in kids:
        env = Path("/proc/%s/environ" % pid).read_bytes().split(b"\0")
        if b"RANK=1" in env:
            victim = int(pid)
    assert victim, kids
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    status, text = srv.http("POST", "/v1/chat/completions", json.dumps(
        {"model": "model", "messages": messages(video_part(file_url(fx.clip)))}))
    assert status == 503, (status, text)
    assert json.loads(text)["error"]["type"] == "server_error"
    code = srv.proc.wait(timeout=30)
    assert code != 0, srv.stderr()
    assert time.time() - t0 < 20, time.time() - t0


def case_port_in_use_fails_every_rank_at_once(fx, srv, ranks):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    t0 = time.time()
    r = subprocess.run([LVX, "serve", "--model", str(fx.model), "--nproc", str(ranks), "--port",
                        str(s.getsockname()[1])], capture_output=True, text=True, timeout=60)
    s.close()
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert re.search(r"cannot listen on 127\.0\.0\.1:\d+ \(--host, --port\)", r.stderr), r.stderr
    assert time.time() - t0 < 30, "took %.1f s: the other ranks waited" % (time.time() - t0)


def case_api_key_stays_secret(fx, srv, ranks):
    # The key comes by environment: no rank's command line holds it; /metrics needs it.
    for pid in descendants(srv.proc.pid) + [srv.proc.pid]:
        try:
            cmdline = Path("/proc/%d/cmdline" % pid).read_bytes()
        except OSError:
            continue
        assert KEY.encode() not in cmdline, (pid, cmdline)
    assert srv.http("GET", "/metrics", key=None)[0] == 401
    assert srv.http("GET", "/metrics")[0] == 200
    expect_error(srv, 401, json.dumps({"model": "model", "messages": []}), key=KEY + "x")
    assert ask(srv, video_part(file_url(fx.clip))).choices[0].message.content is not None


def case_api_key_flag_not_in_rank_argv(fx, srv, ranks):
    # --api-key given: the ranks still get the key by environment, never in their argv.
    for pid in descendants(srv.proc.pid):
        try:
            cmdline = Path("/proc/%d/cmdline" % pid).read_bytes()
        except OSError:
            continue
        assert KEY.encode() not in cmdline, (pid, cmdline)
    assert "visible to every local user" in srv.stderr()
    assert srv.http("GET", "/metrics", key=None)[0] == 200  # --metrics-public
    assert ask(srv, video_part(file_url(fx.clip))).choices[0].message.content is not None


def listening_socket(pids, port):
    """(pid, fd) of the socket listening on 127.0.0.1:`port` among `pids`' open files."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            f = row.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # 0A: LISTEN
                inodes.add("socket:[%s]" % f[9])
    for pid in pids:
        for fd in Path("/proc/%d/fd" % pid).iterdir():
            try:
                if os.readlink(fd) in inodes:
                    return pid, int(fd.name)
            except OSError:
                continue
    raise AssertionError("no process of the server listens on port %d" % port)


def case_stream_socket_has_nodelay(fx, srv, ranks):
    # A stream's tokens are small writes. With Nagle's algorithm each waits for the client's ACK
    # of the one before, which a kept-alive client (the openai package's) delays up to 40 ms: the
    # one-client benchmark measured 18 requests/s against 28 with TCP_NODELAY. Timing that here
    # would depend on the machine, so the option itself is read, from the server's listening
    # socket (Linux gives accepted sockets the listener's TCP_NODELAY) through pidfd_getfd.
    import ctypes
    import socket
    pid, fd = listening_socket([srv.proc.pid] + descendants(srv.proc.pid), srv.port)
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        dup = libc.syscall(438, pidfd, fd, 0)  # SYS_pidfd_getfd (x86-64 and arm64 alike)
        assert dup >= 0, "pidfd_getfd: %s" % os.strerror(ctypes.get_errno())
    finally:
        os.close(pidfd)
    s = socket.socket(fileno=dup)
    try:
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0, "Nagle's algorithm is on"
    finally:
        s.close()  # our duplicate only


def case_emulated_cluster_prints_its_address(fx, srv, ranks):
    # Under `lvx launch --nodes 2 --inter-node R` the ranks run in a private network namespace
    # where an ephemeral loopback listener binds to its node's address (127.0.1.1 for rank 0):
    # `serve --port 0` must print that address, and /health must answer there, asked from inside
    # the namespace (nsenter into the launcher's). Skipped where emulated links are unavailable
    # (no CAP_NET_ADMIN or user namespaces, no tc, no nsenter), as the emulated-links tests are.
    import shutil
    if shutil.which("nsenter") is None or shutil.which("tc") is None:
        print("SKIP: no nsenter or tc")
        return
    proc = subprocess.Popen(
        [LVX, "launch", "--nproc", "2", "--nodes", "2", "--inter-node", "1gbit", "--", LVX,
         "serve", "--model", str(fx.model), "--port", "0", "--api-key", KEY],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        err, url = [], None
        deadline = time.time() + 60
        while time.time() < deadline and url is None:
            line = proc.stderr.readline()
            if not line:
                break
            err.append(line)
            m = re.search(r"listening on (http://[0-9.\[\]:]+:\d+)", line)
            url = m.group(1) if m else None
        text = "".join(err)
        if url is None and ("CAP_NET_ADMIN" in text or "namespace" in text or "tc" in text):
            print("SKIP: no emulated links here:", text[-300:])
            return
        assert url and url.startswith("http://127.0.1.1:"), text[-2000:]
        probe = subprocess.run(
            ["nsenter", "-t", str(proc.pid), "-n", "python3", "-c",
             "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1] + '/health', "
             "timeout=10).status)", url], capture_output=True, text=True, timeout=30)
        assert probe.stdout.strip() == "200", (probe.stdout, probe.stderr)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
