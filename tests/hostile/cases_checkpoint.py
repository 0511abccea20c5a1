"""Hostile checkpoints, safetensors files and config.json files (issue 19, checkpoint slice).

Every bad file class ends in exit 1 with an error naming the file and the problem, through the
commands that read it: `lvx forward` (a model directory and a batch file), `lvx qa` (a model
directory) and `lvx attention` (an input file). The fixtures are the tiny random checkpoints of
tests/reference (Ctx.mplug, Ctx.flamingo) and a batch from mplug_owl3_ref.py make-batch.
"""
import json
import os
import struct
import subprocess
from pathlib import Path

from harness import REFERENCE, Case, f32, safetensors_bytes

# ---- fixtures ---------------------------------------------------------------------------------


def mplug_batch(ctx) -> str:
    """A batch for the tiny mPLUG-Owl3 (input_ids, pixel_values, labels)."""
    model = ctx.mplug()

    def make(d: Path):
        subprocess.run([ctx.python, str(REFERENCE / "mplug_owl3_ref.py"), "make-batch", model,
                        str(d / "batch.safetensors")], check=True, stdout=subprocess.DEVNULL)
    return str(ctx._fixture("mplug_batch", make, [REFERENCE / "mplug_owl3_ref.py"],
                            ["make-batch", model]) / "batch.safetensors")


def flamingo_batch(ctx, lm="mpt") -> str:
    model = ctx.flamingo(lm)

    def make(d: Path):
        subprocess.run([ctx.python, str(REFERENCE / "openflamingo_ref.py"), "make-batch", model,
                        str(d / "batch.safetensors")], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    return str(ctx._fixture("flamingo_batch_" + lm, make, [REFERENCE / "openflamingo_ref.py"],
                            ["make-batch", model]) / "batch.safetensors")


def mplug_sharded(ctx) -> str:
    def make(d: Path):
        subprocess.run([ctx.python, str(REFERENCE / "mplug_owl3_ref.py"), "make-model", str(d),
                        "--variant", "240728", "--shards", "2"], check=True,
                       stdout=subprocess.DEVNULL)
    return str(ctx._fixture("mplug_sharded", make, [REFERENCE / "mplug_owl3_ref.py"],
                            ["make-model", "240728", "--shards", "2"]))


def forward(ctx, model, batch=None):
    return ["forward", "--model", model, "--input", batch or mplug_batch(ctx), "--output",
            ctx.path("out.safetensors")]


def no_output(ctx, res):
    assert not os.path.exists(ctx.path("out.safetensors")), "an output was written"


RANK_FAILED = r"error:|exited with code 1"


def on_rank(regex):
    """For errors a rank finds (the weights are read by the ranks, not by the launcher): `lvx
    launch` forwards each rank's stderr to its own stderr (prefixed), so the named error must be
    there and not on stdout, and no output may have been written."""
    import re

    def check(ctx, res):
        assert re.search(regex, res.stderr, re.S | re.I), "no /%s/ on stderr" % regex
        assert not re.search(regex, res.stdout, re.S | re.I), "/%s/ on stdout" % regex
        no_output(ctx, res)
    return check


def split(path):
    """(header dict, header length, data bytes) of a safetensors file."""
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), n, raw[8 + n:]


def rewrite(path, fn):
    """Rewrites a safetensors file's header with fn(header) (data kept as it is)."""
    header, _, data = split(path)
    fn(header)
    Path(path).write_bytes(safetensors_bytes(header=header, data=data))


def model_with(ctx, edit, src=None):
    """A copy of the tiny mPLUG-Owl3 with edit(dir) applied."""
    d = ctx.copy_model(src or ctx.mplug())
    edit(d)
    return d


def with_config(ctx, edit, src=None):
    def apply(d):
        p = os.path.join(d, "config.json")
        c = json.load(open(p))
        edit(c)
        json.dump(c, open(p, "w"))
    return model_with(ctx, apply, src)


def fnv1a64(path):
    h = 1469598103934665603
    for b in Path(path).read_bytes():
        h ^= b
        h = (h * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def manifest_then_flip(d):
    """Writes manifest.json (fnv1a64 entries, the format before xxHash) for every file of d, then
    flips one bit of the last weight byte of model.safetensors."""
    files = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        files[name] = {"bytes": os.path.getsize(p), "fnv1a64": fnv1a64(p)}
    json.dump({"format": 1, "files": files}, open(os.path.join(d, "manifest.json"), "w"))
    p = os.path.join(d, "model.safetensors")
    raw = bytearray(Path(p).read_bytes())
    raw[-1] ^= 0x01
    Path(p).write_bytes(bytes(raw))


def attention_input(ctx, header, data):
    return ["attention", "--strategy", "ring", "--nproc", "1", "--input",
            ctx.write("in.safetensors", safetensors_bytes(header=header, data=data)), "--output",
            ctx.path("out.safetensors")]


QKV = 2 * 1 * 1 * 4 * 4  # bytes of one f32 [1, 2, 1, 4] tensor


def qkv_header(k_offsets, v_offsets):
    return {"q": {"dtype": "F32", "shape": [1, 2, 1, 4], "data_offsets": [0, QKV]},
            "k": {"dtype": "F32", "shape": [1, 2, 1, 4], "data_offsets": k_offsets},
            "v": {"dtype": "F32", "shape": [1, 2, 1, 4], "data_offsets": v_offsets}}


def batch_file(ctx, name, header=None, data=b"", raw=None, **kw):
    if raw is None:
        raw = safetensors_bytes(header=header, data=data, **kw)
    return ctx.write(name, raw)


IDS = struct.pack("<4q", 1, 2, 3, 4)  # int64 [1, 4]


def ids_header(**entry):
    e = {"dtype": "I64", "shape": [1, 4], "data_offsets": [0, 32]}
    e.update(entry)
    return {"input_ids": e}


def beyond_memory(ctx):
    """The tiny mPLUG-Owl3 widened to a 17-billion-parameter embedding (vocab 2^24 × 1024: 34 GB
    in bf16, 69 GB in fp32) in a sparse model.safetensors: its header is whole and valid, its data
    holes; no machine of this kind can hold it."""
    def edit(d):
        p = os.path.join(d, "config.json")
        c = json.load(open(p))
        c.update(hidden_size=1024, vocab_size=1 << 24, tie_word_embeddings=True)
        json.dump(c, open(p, "w"))
        plan = json.loads(subprocess.run([ctx.lvx, "init-model", "--config", p, "--out",
                                          os.path.join(d, "unused"), "--dry-run", "--list",
                                          "--json"], check=True, capture_output=True,
                                         text=True).stdout)
        header, at = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in sorted(plan["tensors"].items()):
            n = 2
            for x in shape:
                n *= x
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + n]}
            at += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + at)  # sparse: the data are holes
    return model_with(ctx, edit)


def shard_edit(ctx, fn):
    """The two-shard tiny mPLUG-Owl3 with fn(path of its second shard) applied."""
    return model_with(ctx, lambda d: fn(os.path.join(d, "model-00002-of-00002.safetensors")),
                      src=mplug_sharded(ctx))


def truncate_by(n):
    def cut(p):
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) - n)
    return cut


# ---- safetensors: the batch file of lvx forward ------------------------------------------------

CASES = [
    Case("st_header_short_by_one_byte",
         lambda c: forward(c, c.mplug(), batch_file(
             c, "b.safetensors", raw=(lambda r: struct.pack("<Q", struct.unpack("<Q", r[:8])[0] - 1)
                                      + r[8:])(Path(mplug_batch(c)).read_bytes()))),
         stderr=r"b\.safetensors.*(bytes after the last tensor|not valid JSON)", check=no_output),
    Case("st_header_length_past_end",
         lambda c: forward(c, c.mplug(), batch_file(c, "b.safetensors", ids_header(), IDS,
                                                    header_len=1 << 40)),
         stderr=r"b\.safetensors: header length 1099511627776 exceeds the file size"),
    Case("st_header_length_over_cap",
         # A sparse 200 MB file: the length fits the file but not the 100 MB bound.
         lambda c: forward(c, c.mplug(), (lambda p: (os.truncate(p, 200_000_016), p)[1])(
             c.write("b.safetensors", struct.pack("<Q", 200_000_000) + b"{}"))),
         stderr=r"header length 200000000 is more than the 100000000 bytes", max_rss_mb=1024),
    Case("st_header_not_json",
         lambda c: forward(c, c.mplug(), batch_file(c, "b.safetensors", b'{"input_ids": {', IDS)),
         stderr=r"b\.safetensors: header is not valid JSON"),
    Case("st_header_deep_json",
         lambda c: forward(c, c.mplug(), batch_file(c, "b.safetensors",
                                                    b'{"a":' * 5000 + b'1' + b'}' * 5000, b"")),
         stderr=r"b\.safetensors: header: JSON nested deeper than 64"),
    Case("st_duplicate_tensor_name",
         lambda c: forward(c, c.mplug(), batch_file(
             c, "b.safetensors",
             b'{"input_ids": {"dtype": "I64", "shape": [1, 4], "data_offsets": [0, 32]}, '
             b'"input_ids": {"dtype": "I64", "shape": [1, 4], "data_offsets": [32, 64]}}',
             IDS + struct.pack("<4q", 9, 9, 9, 9))),
         stderr=r"b\.safetensors: header names 'input_ids' twice"),
    Case("st_unknown_dtype",
         lambda c: forward(c, c.mplug(), batch_file(c, "b.safetensors",
                                                    ids_header(dtype="Q4_K"), IDS)),
         stderr=r"tensor 'input_ids': dtype 'Q4_K' is not supported"),
    Case("st_negative_shape",
         lambda c: forward(c, c.mplug(), batch_file(c, "b.safetensors",
                                                    ids_header(shape=[-1, -4]), IDS)),
         stderr=r"tensor 'input_ids': shape: expected non-negative integers"),
    Case("st_shape_overflow",
         lambda c: forward(c, c.mplug(), batch_file(
             c, "b.safetensors", ids_header(shape=[1 << 62, 1 << 62], data_offsets=[0, 0]), b"")),
         stderr=r"tensor 'input_ids': shape .* is too large"),
    Case("st_span_not_shape",
         lambda c: forward(c, c.mplug(), batch_file(c, "b.safetensors",
                                                    ids_header(data_offsets=[0, 24]), IDS[:24])),
         stderr=r"tensor 'input_ids': data_offsets \[0, 24\] hold 24 bytes but its shape"),
    Case("st_wrapped_offsets",
         lambda c: forward(c, c.mplug(), batch_file(c, "b.safetensors",
                                                    ids_header(data_offsets=[32, 0]), IDS)),
         stderr=r"data_offsets \[32, 0\] end before they begin"),
    Case("st_offsets_past_end",
         lambda c: forward(c, c.mplug(), batch_file(c, "b.safetensors",
                                                    ids_header(data_offsets=[8, 40]), IDS)),
         stderr=r"b\.safetensors: tensor 'input_ids' begins at byte 8 of the data"),
    Case("st_trailing_bytes",
         lambda c: forward(c, c.mplug(), batch_file(c, "b.safetensors", ids_header(),
                                                    IDS + b"garbage!")),
         stderr=r"b\.safetensors: 8 bytes after the last tensor"),
    Case("st_truncated",
         lambda c: forward(c, c.mplug(), batch_file(
             c, "b.safetensors", raw=Path(mplug_batch(c)).read_bytes()[:-100])),
         stderr=r"b\.safetensors: tensor '\w+' ends at byte \d+ of the data but the file holds "
                r"only"),
    Case("st_fifo",
         lambda c: forward(c, c.mplug(), c.fifo("b.safetensors")),
         stderr=r"b\.safetensors.*FIFO", timeout=30),
    Case("st_directory",
         lambda c: forward(c, c.mplug(), (os.mkdir(c.path("b.safetensors")),
                                          c.path("b.safetensors"))[1]),
         stderr=r"b\.safetensors.*directory"),

    # ---- lvx attention: tensors aliasing each other's bytes ----------------------------------
    Case("attention_inputs_alias",
         lambda c: attention_input(c, qkv_header([QKV, 2 * QKV], [QKV, 2 * QKV]),
                                   f32(*range(16)) + f32(*range(8))),
         stderr=r"in\.safetensors: tensors 'k' and 'v' overlap"),
    Case("attention_inputs_overlap_partly",
         lambda c: attention_input(c, qkv_header([QKV, 2 * QKV], [QKV + 16, 2 * QKV + 16]),
                                   f32(*range(16)) + f32(*range(12))),
         stderr=r"in\.safetensors: tensors 'k' and 'v' overlap"),

    # ---- checkpoint tensors ------------------------------------------------------------------
    Case("ckpt_int32_weight",
         lambda c: forward(c, model_with(c, lambda d: subprocess.run(
             [c.python, "-c",
              "import sys, torch; from safetensors.torch import load_file, save_file; "
              "p = sys.argv[1]; t = load_file(p); "
              "n = 'language_model.model.layers.0.mlp.up_proj.weight'; "
              "t[n] = (t[n] * 1000).to(torch.int32); save_file(t, p, {'format': 'pt'})",
              os.path.join(d, "model.safetensors")], check=True))),
         stderr=RANK_FAILED, check=on_rank(r"not floating-point .*mlp\.up_proj\.weight Int")),
    Case("ckpt_header_short_by_one_byte",
         lambda c: forward(c, model_with(c, lambda d: (lambda p: Path(p).write_bytes(
             (lambda r: struct.pack("<Q", struct.unpack("<Q", r[:8])[0] - 1) + r[8:])(
                 Path(p).read_bytes())))(os.path.join(d, "model.safetensors")))),
         stderr=RANK_FAILED,
         check=on_rank(r"model\.safetensors.*(bytes after the last tensor|not valid JSON)")),
    Case("ckpt_overlapping_weights",
         lambda c: forward(c, model_with(c, lambda d: rewrite(
             os.path.join(d, "model.safetensors"),
             lambda h: h["language_model.model.norm.weight"].__setitem__(
                 "data_offsets", h["language_model.model.layers.0.input_layernorm.weight"]
                 ["data_offsets"])))),
         stderr=RANK_FAILED, check=on_rank(r"model\.safetensors: .*(overlap|gap)")),
    # Refused before anything is read, naming the bytes: the OOM killer would end the load halfway.
    Case("ckpt_weights_beyond_memory_fp32",
         lambda c: forward(c, beyond_memory(c)) + ["--dtype", "fp32"],
         stderr=RANK_FAILED, timeout=120,
         check=on_rank(r"not enough memory: the weights need [0-9.]+ GB in fp32 .* available")),
    Case("ckpt_weights_beyond_memory_in_place",
         lambda c: forward(c, beyond_memory(c)) + ["--dtype", "bf16"],
         stderr=RANK_FAILED, timeout=120,
         check=on_rank(r"not enough memory: the weights need [0-9.]+ GB in bf16 .* available")),
    Case("ckpt_missing_shard",
         lambda c: forward(c, shard_edit(c, os.remove)),
         stderr=RANK_FAILED, check=on_rank(r"model-00002-of-00002\.safetensors.*cannot open")),
    Case("ckpt_truncated_shard",
         lambda c: forward(c, shard_edit(c, truncate_by(100))),
         stderr=RANK_FAILED,
         check=on_rank(r"model-00002-of-00002\.safetensors: .*(truncated|holds only)")),
    Case("ckpt_index_outside_dir",
         lambda c: forward(c, model_with(c, lambda d: (lambda p: json.dump(
             (lambda j: (j["weight_map"].__setitem__(next(iter(j["weight_map"])),
                                                     "../../outside.safetensors"), j)[1])(
                 json.load(open(p))), open(p + ".new", "w")) or os.replace(p + ".new", p))(
             os.path.join(d, "model.safetensors.index.json")), src=mplug_sharded(c))),
         stderr=RANK_FAILED,
         check=on_rank(r"model\.safetensors\.index\.json: file name '\.\./\.\./outside\.safetensors' "
                       r"is not a plain file name")),
    Case("ckpt_index_absolute",
         lambda c: forward(c, model_with(c, lambda d: (lambda p: json.dump(
             (lambda j: (j["weight_map"].__setitem__(next(iter(j["weight_map"])),
                                                     "/etc/passwd"), j)[1])(
                 json.load(open(p))), open(p + ".new", "w")) or os.replace(p + ".new", p))(
             os.path.join(d, "model.safetensors.index.json")), src=mplug_sharded(c))),
         stderr=RANK_FAILED, check=on_rank(r"file name '/etc/passwd' is not a plain file name")),
    Case("ckpt_manifest_flipped_byte_forward",
         lambda c: forward(c, model_with(c, manifest_then_flip)),
         stderr=RANK_FAILED,
         check=on_rank(r"corrupt checkpoint: model\.safetensors has fnv1a64 checksum")),
    Case("ckpt_manifest_flipped_byte_qa",
         lambda c: ["qa", "--model", model_with(c, manifest_then_flip), "--video", c.clip(),
                    "--question", "What is shown?", "--num-frames", "2"],
         stderr=RANK_FAILED,
         check=on_rank(r"corrupt checkpoint: model\.safetensors has fnv1a64 checksum")),

    # ---- config.json ---------------------------------------------------------------------------
    Case("config_zero_heads",
         lambda c: forward(c, with_config(c, lambda j: j.__setitem__("num_attention_heads", 0))),
         stderr=r"config\.json: num_attention_heads: expected an integer in \[1, \d+\], got 0"),
    Case("config_kv_heads_not_dividing",
         lambda c: forward(c, with_config(c, lambda j: j.__setitem__("num_key_value_heads", 3))),
         stderr=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    Case("config_billion_layers",
         lambda c: forward(c, with_config(c, lambda j: j.__setitem__("num_hidden_layers", 10**9))),
         stderr=r"num_hidden_layers: expected an integer in \[1, 1024\], got 1000000000",
         max_rss_mb=1024, timeout=30),
    Case("config_vocab_1e12",
         lambda c: forward(c, with_config(c, lambda j: j.__setitem__("vocab_size", 10**12))),
         stderr=r"vocab_size: expected an integer in \[1, \d+\], got 1000000000000",
         max_rss_mb=1024),
    Case("config_gigapixel_image",
         lambda c: forward(c, with_config(c, lambda j: j["vision_config"].__setitem__(
             "image_size", 31623))),
         stderr=r"vision_config: image_size: expected an integer in \[1, 8192\], got 31623",
         max_rss_mb=1024),
    Case("config_zero_patch",
         lambda c: forward(c, with_config(c, lambda j: j["vision_config"].__setitem__(
             "patch_size", 0))),
         stderr=r"vision_config: patch_size: expected an integer in \[1, \d+\], got 0"),
    Case("config_negative_eps",
         lambda c: forward(c, with_config(c, lambda j: j.__setitem__("rms_norm_eps", -1e-6))),
         stderr=r"rms_norm_eps: expected a positive number, got -1e-06"),
    Case("config_zero_rope_theta",
         lambda c: forward(c, with_config(c, lambda j: j.__setitem__("rope_theta", 0))),
         stderr=r"rope_theta: expected a positive number, got 0"),
    Case("config_unknown_act",
         lambda c: forward(c, with_config(c, lambda j: j.__setitem__("hidden_act", "swiglu9"))),
         stderr=r"config\.json: hidden_act: activation 'swiglu9' is not supported"),
    Case("config_vision_act_not_string",
         lambda c: forward(c, with_config(c, lambda j: j["vision_config"].__setitem__(
             "hidden_act", 7))),
         stderr=r"vision_config: hidden_act: expected a string, got 7"),
    Case("config_hidden_not_multiple",
         lambda c: forward(c, with_config(c, lambda j: j.__setitem__("hidden_size", 66))),
         stderr=r"hidden_size \(66\) must be a multiple of num_attention_heads \(4\)"),
    Case("config_fifo",
         lambda c: forward(c, model_with(c, lambda d: (os.remove(os.path.join(d, "config.json")),
                                                       os.mkfifo(os.path.join(d, "config.json"))))),
         stderr=r"config\.json' is a FIFO", timeout=30),
    Case("config_deep_json",
         lambda c: forward(c, model_with(c, lambda d: Path(d, "config.json").write_text(
             "[" * 100000 + "]" * 100000))),
         stderr=r"config\.json': JSON nested deeper than 64"),
    Case("config_not_object",
         lambda c: forward(c, model_with(c, lambda d: Path(d, "config.json").write_text("[1]"))),
         stderr=r"config\.json: expected a JSON object, got array"),
    Case("flamingo_zero_heads",
         lambda c: forward(c, with_config(c, lambda j: j["text_config"].__setitem__("n_heads", 0),
                                          src=c.flamingo("mpt")), flamingo_batch(c)),
         stderr=r"text_config: n_heads: expected an integer in \[1, \d+\], got 0"),
    Case("flamingo_zero_vision_heads",
         lambda c: forward(c, with_config(c, lambda j: j["vision_config"].__setitem__("heads", 0),
                                          src=c.flamingo("mpt")), flamingo_batch(c)),
         stderr=r"vision_config: heads: expected an integer in \[1, \d+\], got 0"),
    Case("flamingo_zero_patch",
         lambda c: forward(c, with_config(c, lambda j: j["vision_config"].__setitem__(
             "patch_size", 0), src=c.flamingo("mpt")), flamingo_batch(c)),
         stderr=r"vision_config: patch_size: expected an integer in \[1, \d+\], got 0"),
    Case("flamingo_neox_zero_heads",
         lambda c: forward(c, with_config(c, lambda j: j["text_config"].__setitem__(
             "num_attention_heads", 0), src=c.flamingo("gpt_neox")), flamingo_batch(c, "gpt_neox")),
         stderr=r"text_config: num_attention_heads: expected an integer in \[1, \d+\], got 0"),
    Case("flamingo_cross_layer_out_of_range",
         lambda c: forward(c, with_config(c, lambda j: j.__setitem__("cross_attn_layers", [0, 99]),
                                          src=c.flamingo("mpt")), flamingo_batch(c)),
         stderr=r"cross_attn_layers: expected 0-based layer indices in \[0, \d+\), got 99"),
    Case("flamingo_media_token_outside_vocab",
         lambda c: forward(c, with_config(c, lambda j: j.__setitem__("media_token_id", 10**6),
                                          src=c.flamingo("mpt")), flamingo_batch(c)),
         stderr=r"media_token_id: expected an integer in \[0, \d+\], got 1000000"),
]
