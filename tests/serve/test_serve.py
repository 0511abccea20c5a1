"""lvx serve end to end: a real server on 127.0.0.1 (a free port) at 1 or 2 ranks, spoken to with
the `openai` package (PyPI) and raw HTTP.

  python test_serve.py RANKS [-k SUBSTRING]    (LVX_BIN names the binary)

Each case is bounded (60 s) and asserts against an independent reference where there is one:
answers against `lvx qa --json` on the same video, frames and question (greedy, token for token:
the text and the token counts); image_url frames against lvx qa on the video they were cut from
(ffmpeg's PNGs of the frames lvx qa sampled); every error code by its status and OpenAI's error
shape; the visual cache by the hit counters of /metrics (every rank hits on a repeat, none after
the file changed); a killed rank by the 503 and the server's non-zero exit; SIGTERM by a stream
that still completes and an exit code of 0. Ends with the summary line "N passed, N failed".

This file is the entry point the two CTest runs (1 and 2 ranks) call: it holds the CASES table
they walk and the loop that runs it. The cases live beside it by concern, sharing the fixtures,
the server and the request helpers of harness.py: cases_answers.py (answers and the chat API's
shapes), cases_cache.py (visual cache and uploads), cases_batching.py (scheduling and batching),
cases_errors.py (errors, hostile input, limits), cases_process.py (signals, ranks, the API key),
cases_hostile_clients.py (what a client without the key, or a slow one, can cost the server),
cases_openai.py (OpenAI semantics: n choices; the cache gauge; a chat without video; /v1/completions).
"""
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from cases_answers import (
    case_answers_equal_lvx_qa, case_conversation_template, case_frame_settings_per_request,
    case_image_frames, case_logprobs, case_streaming)
from cases_batching import (
    case_chunked_prefill, case_distinct_questions_batched,
    case_identical_requests_share_generation, case_nonstreaming_client_leaves,
    case_queue_full_429, case_stop_and_disconnect)
from cases_cache import (
    case_cache_hits_and_changed_file, case_uploads_stay_private, case_uuid_scoped_to_key)
from cases_errors import (
    case_error_codes, case_fuzz, case_hostile_bodies, case_hostile_framing, case_inflight_budget)
from cases_process import (
    case_api_key_flag_not_in_rank_argv, case_api_key_stays_secret,
    case_emulated_cluster_prints_its_address, case_killed_rank_503,
    case_port_in_use_fails_every_rank_at_once, case_sigterm_finishes_in_flight,
    case_stream_socket_has_nodelay)
from cases_hostile_clients import (
    case_cache_is_private_to_each_key, case_fps_obeys_max_frames,
    case_refused_uploads_read_their_answer, case_unseeded_sampling_is_fresh, case_slow_body_gets_408,
    case_kv_budget,
    case_slow_headers_do_not_hang, case_unauthenticated_cannot_lock_out)
from cases_openai import (
    case_cache_gauge_follows_prefill, case_completions, case_n_choices, case_text_only_chat)
from harness import KEY, KEY2, Fixtures, Server


# (case, server flags (None: the case starts what it needs), environment, ranks it needs, stops
# the server itself)
CASES = [
    (case_answers_equal_lvx_qa, [], {}, 1, False),
    (case_streaming, [], {}, 1, False),
    (case_image_frames, [], {}, 1, False),
    (case_conversation_template, [], {}, 1, False),
    (case_cache_hits_and_changed_file, [], {}, 1, False),
    (case_error_codes, ["--max-body-bytes", str(200 << 10)], {}, 1, False),
    (case_queue_full_429, ["--max-queue", "1", "--max-batch", "1"], {}, 1, False),
    (case_stop_and_disconnect, [], {}, 1, False),
    (case_nonstreaming_client_leaves, ["--max-batch", "1"], {}, 1, False),
    (case_identical_requests_share_generation, ["--max-batch", "1"], {}, 1, False),
    (case_distinct_questions_batched, ["--step-overlap", "on"], {}, 1, False),
    (case_chunked_prefill, ["--max-batch-tokens", "4", "--max-batch-visual-keys", "128"], {}, 1,
     False),
    (case_sigterm_finishes_in_flight, [], {}, 1, True),
    (case_killed_rank_503, [], {"LVX_DIST_TIMEOUT_S": "4"}, 2, True),
    (case_port_in_use_fails_every_rank_at_once, None, {}, 1, True),
    (case_emulated_cluster_prints_its_address, None, {}, 2, True),
    (case_hostile_bodies, [], {}, 1, False),
    (case_hostile_framing, [], {}, 1, False),
    (case_fuzz, [], {}, 1, False),
    (case_frame_settings_per_request, [], {}, 1, False),
    (case_uploads_stay_private, ["--cache-bytes", "0"], {"LVX_INDEX_CACHE": "@index"}, 1, False),
    (case_api_key_stays_secret, "env-key", {"LVX_API_KEY": KEY}, 1, False),
    (case_api_key_flag_not_in_rank_argv, ["--metrics-public"], {}, 1, False),
    (case_uuid_scoped_to_key, "keys-file", {}, 1, False),
    (case_logprobs, [], {}, 1, False),
    (case_inflight_budget, ["--max-inflight-bytes", str(3 << 20)], {}, 1, False),
    (case_stream_socket_has_nodelay, [], {}, 1, False),
    (case_unauthenticated_cannot_lock_out, ["--max-inflight-bytes", str(3 << 20)], {}, 1, False),
    (case_slow_headers_do_not_hang, ["--max-connections", "32", "--header-timeout", "2"], {}, 1,
     False),
    (case_slow_body_gets_408, [], {}, 1, False),
    (case_refused_uploads_read_their_answer, ["--max-inflight-bytes", str(3 << 20)], {}, 1,
     False),
    (case_fps_obeys_max_frames, ["--max-frames", "40"], {}, 1, False),
    (case_cache_is_private_to_each_key, "keys-file", {}, 1, False),
    (case_unseeded_sampling_is_fresh, [], {}, 1, False),
    (case_kv_budget, ["--max-kv-bytes", "150000"], {}, 1, False),
    (case_n_choices, [], {}, 1, False),
    (case_cache_gauge_follows_prefill, ["--max-batch", "2"], {}, 1, False),
    (case_text_only_chat, [], {}, 1, False),
    (case_completions, [], {}, 1, False),
]


def main():
    ranks = int(sys.argv[1])
    only = sys.argv[sys.argv.index("-k") + 1] if "-k" in sys.argv else ""
    root = Path(os.environ.get("LVX_SERVE_TEST_DIR",
                               Path(tempfile.gettempdir()) / ("lvx-serve-test-%d" % os.getuid())))
    fx = Fixtures(root)
    # A temporary folder of this run's own, for the servers (TMPDIR) and the cases: ctest runs the
    # 1- and 2-rank suites at once, and a case that looks for upload folders left in a shared
    # /tmp would see the other suite's server at work.
    tmp = fx.root / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    passed = failed = 0
    shared = None  # cases without flags share one server
    for case, flags, env, need, stops in CASES:
        name = "%s[%d ranks]" % (case.__name__[5:], ranks)
        if ranks < need or only not in name:
            continue
        t0 = time.time()
        srv = None
        try:
            env = {k: (str(fx.root / "index") if v == "@index" else v) for k, v in env.items()}
            if "LVX_INDEX_CACHE" in env:
                os.environ["LVX_TEST_INDEX_DIR"] = env["LVX_INDEX_CACHE"]
                Path(env["LVX_INDEX_CACHE"]).mkdir(parents=True, exist_ok=True)
            if flags is None:
                srv = None
            elif flags == "env-key":
                srv = Server(fx, ranks, env=env, key_flag=False)
            elif flags == "keys-file":  # two tenants' keys, one per line
                keys = fx.root / "keys.txt"
                keys.write_text(KEY + "\n" + KEY2 + "\n")
                srv = Server(fx, ranks, "--api-key-file", str(keys), env=env, key_flag=False)
            elif not flags and not env and not stops:
                shared = shared or Server(fx, ranks)
                srv = shared
            else:
                srv = Server(fx, ranks, *flags, env=env)
            done = threading.Event()
            timer = threading.Timer(
                60, lambda: (done.is_set() or srv is None or os.killpg(srv.proc.pid, 9)))
            timer.start()
            try:
                case(fx, srv, ranks)
            finally:
                done.set()
                timer.cancel()
            assert time.time() - t0 < 60, "took %.1f s" % (time.time() - t0)
            passed += 1
            print("PASS %s (%.1f s)" % (name, time.time() - t0), flush=True)
        except Exception:
            failed += 1
            print("FAIL %s (%.1f s)\n%s" % (name, time.time() - t0, traceback.format_exc()),
                  flush=True)
            if srv:
                print("server stderr:\n" + srv.stderr()[-3000:], flush=True)
        finally:
            if srv is not None and srv is not shared and srv.proc.poll() is None:
                srv.stop()
    if shared is not None:
        code = shared.stop()
        if code != 0:
            failed += 1
            print("FAIL shared server exit code %s\n%s" % (code, shared.stderr()[-3000:]))
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
