"""Hostile flags and paths for the commands that compute: non-finite and overflowing numbers,
counts beyond what the input can give (frames, fps, sizes, threads, ranks), non-regular files
given as inputs or outputs, and where a rank's errors go through `lvx launch`."""
import json
import os

from harness import Case


def clip(ctx):
    return ctx.clip()


def decode(ctx, *flags):
    return ["decode", "--video", ctx.clip(), "--output", ctx.path("out.safetensors")] + list(flags)


def not_on_stdout(pattern):
    def check(ctx, res):
        assert pattern not in res.stdout, "stdout holds %r: %r" % (pattern, res.stdout[-300:])
    return check


def stays_absent(name):
    def check(ctx, res):
        assert not os.path.exists(ctx.path(name)), "%s was written" % name
    return check


def streams_apart(res):
    assert "[rank 1] out1" in res.stdout, "stdout lost rank 1's result: %r" % res.stdout
    assert "err" not in res.stdout, "a rank's stderr reached stdout: %r" % res.stdout
    assert "out1" not in res.stderr, "a rank's stdout reached stderr: %r" % res.stderr


def corrupt_video(ctx):
    return ctx.write("corrupt.mp4", b"this is not a video\n" * 64)


def tokenize_hi(ctx):
    return ["tokenize", "--tokenizer", os.path.join(ctx.mplug(), "tokenizer.json"), "--text", "hi"]


CASES = [
    # A command that computes nothing starts light: libtorch's CUDA half is not loaded on a machine
    # without an NVIDIA driver (it took every lvx process to ~500 MB resident).
    Case("tokenize_stays_light", tokenize_hi, rc=0, max_rss_mb=300),
    Case("launched_ranks_start_light",
         lambda c: ["launch", "--nproc", "2", "--", c.lvx] + tokenize_hi(c), rc=0, max_rss_mb=300),
    # ---- numbers in flags ------------------------------------------------------------------
    Case("flag_double_nan", ["launch", "--nproc", "1", "--timeout", "nan", "--", "true"],
         stderr=r"--timeout expects a finite number, got 'nan'"),
    Case("flag_double_inf", ["launch", "--nproc", "1", "--grace", "inf", "--", "true"],
         stderr=r"--grace expects a finite number, got 'inf'"),
    Case("flag_int_overflow", ["launch", "--nproc", "99999999999999999999", "--", "true"],
         stderr=r"--nproc is out of range: '99999999999999999999' does not fit a 64-bit integer"),
    Case("flag_int_narrowing", ["launch", "--nproc", "1", "--master-port", "4294967297", "--",
                                "true"],
         stderr=r"--master-port must be in \[0, 65535\], got 4294967297"),
    Case("decode_mean_nan", lambda c: decode(c, "--num-frames", "2", "--normalize", "--mean",
                                             "nan,0.5,0.5"),
         stderr=r"--mean expects finite numbers, got 'nan'",
         check=stays_absent("out.safetensors")),
    # ---- counts beyond what the input can give --------------------------------------------
    Case("decode_num_frames_huge", lambda c: decode(c, "--num-frames", "1000000000"),
         stderr=r"num_frames 1000000000 is more than the range .* can give",
         check=stays_absent("out.safetensors")),
    Case("decode_fps_huge", lambda c: decode(c, "--fps", "1e9"),
         stderr=r"fps 1e\+09 over .* asks for about .* frames.*lower the fps",
         check=stays_absent("out.safetensors")),
    Case("decode_size_huge", lambda c: decode(c, "--num-frames", "2", "--size", "100000"),
         stderr=r"--size must be in \[1, 8192\], got 100000", check=stays_absent("out.safetensors")),
    Case("decode_preprocess_threads_huge",
         lambda c: decode(c, "--num-frames", "2", "--preprocess-threads", "100000"),
         stderr=r"--preprocess-threads must be in \[1, 256\], got 100000"),
    Case("decode_queue_huge", lambda c: decode(c, "--num-frames", "2", "--queue", "1000000000"),
         stderr=r"--queue must be in \[1, 1024\]"),
    # A range past the video's end is clamped to it, said on stderr (not an error).
    Case("decode_end_past_duration",
         lambda c: decode(c, "--num-frames", "2", "--start", "0", "--end", "1000000"), rc=0,
         stderr=r"end 1e\+06 s is past the end of the video \(4 s\): sampling up to the end"),
    Case("decode_start_past_duration",
         lambda c: decode(c, "--num-frames", "2", "--start", "1000000"),
         stderr=r"start 1e\+06 s is at or past the end of the video"),
    # ---- ranks and threads -------------------------------------------------------------------
    Case("launch_nproc_1000", ["launch", "--nproc", "1000", "--", "true"],
         stderr=r"--nproc 1000 is more than 4 ranks per core of this machine.*--force-nproc"),
    Case("forward_nproc_1000", lambda c: ["forward", "--model", c.dir, "--input", c.path("in"),
                                          "--output", c.path("out"), "--nproc", "1000"],
         stderr=r"--nproc 1000 is more than 4 ranks per core"),
    Case("attention_scale_negative",
         lambda c: ["attention", "--input", c.path("in"), "--output", c.path("out"), "--scale",
                    "-1"], stderr=r"--scale must be >= 0"),
    Case("threads_zero", lambda c: ["launch", "--nproc", "1", "--", c.lvx, "forward", "--model",
                                    c.dir, "--input", c.path("in"), "--output", c.path("out"),
                                    "--threads", "0"],
         stderr=r"--threads must be in \[1, 4096\], got 0"),
    # ---- non-regular files ----------------------------------------------------------------
    Case("decode_video_fifo", lambda c: ["decode", "--video", c.fifo("v.mp4"), "--num-frames",
                                         "2", "--output", c.path("out.safetensors")],
         stderr=r"v\.mp4'?: is a FIFO", timeout=30),
    Case("decode_video_directory", lambda c: ["decode", "--video", c.dir, "--num-frames", "2",
                                              "--output", c.path("out.safetensors")],
         stderr=r"is a directory"),
    Case("decode_output_directory", lambda c: ["decode", "--video", c.clip(), "--num-frames",
                                               "2", "--output", c.dir],
         stderr=r"output file \(--output\) '.*' is a directory, not a regular file"),
    Case("decode_output_fifo", lambda c: ["decode", "--video", c.clip(), "--num-frames", "2",
                                          "--output", c.fifo("out.safetensors")],
         stderr=r"output file \(--output\) '.*' is a FIFO", timeout=30),
    # ---- streams: a rank's errors on stderr, results on stdout --------------------------------
    Case("launch_rank_stderr_stays_on_stderr",
         ["launch", "--nproc", "2", "--", "sh", "-c",
          "echo out$RANK; echo err$RANK >&2; if [ $RANK = 1 ]; then exit 3; fi; sleep 30"],
         rc=3, stderr=r"\[rank 1\] err1", check=lambda ctx, res: streams_apart(res)),
    Case("launch_qa_rank_error_not_on_stdout",
         lambda c: ["launch", "--nproc", "2", "--", c.lvx, "qa", "--model", c.mplug(), "--video",
                    corrupt_video(c), "--question", "What?", "--num-frames", "2"],
         stderr=r"\[rank 1\].*corrupt\.mp4", check=not_on_stdout("corrupt.mp4"), timeout=120),
]

CASES += [
    Case("attention_input_fifo", lambda c: ["attention", "--input", c.fifo("in.safetensors"),
                                            "--output", c.path("out.safetensors")],
         stderr=r"input file \(--input\) '.*' is a FIFO", timeout=30),
    Case("attention_stats_directory",
         lambda c: ["attention", "--input", c.write("in.safetensors", b"x"), "--output",
                    c.path("out.safetensors"), "--stats", c.dir],
         stderr=r"stats file \(--stats\) '.*' is a directory"),
    Case("forward_input_fifo", lambda c: ["forward", "--model", c.dir, "--input",
                                          c.fifo("in.safetensors"), "--output", c.path("out")],
         stderr=r"input file \(--input\) '.*' is a FIFO", timeout=30),
    Case("forward_output_directory",
         lambda c: ["forward", "--model", c.dir, "--input", c.write("in.safetensors", b"x"),
                    "--output", c.dir],
         stderr=r"output file \(--output\) '.*' is a directory"),
]
