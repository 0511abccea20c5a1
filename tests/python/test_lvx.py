"""`import lvx` under torchrun (Gloo, 1-4 processes): run as
    python -m torch.distributed.run --standalone --nproc_per_node N tests/python/test_lvx.py [case…]

Cases (all by default):
  exact     every strategy × mask (none, causal, causal with Sq < Skv, both media rules, padding)
            × MHA/GQA, fp64, uneven shards: this rank's output and dq, dk, dv against
            torch.nn.functional.scaled_dot_product_attention in fp64 on the gathered tensors
            (|err| ≤ 1e-10; fp32 ≤ 2e-5), and the byte counters equal to the strategy's schedule
  errors    wrong shapes, a group of the wrong size, heads ulysses cannot split: ValueError with
            the message the CLI prints (the same C++ checks; two compared with `lvx attention`'s
            stderr on a file with the same mistake)
  compile   torch.compile(fullgraph=True, backend="aot_eager") traces the op (no graph break):
            output and gradients equal eager's
  patch_hf  a tiny transformers Qwen2 patched with lvx.patch, two AdamW steps sequence-parallel
            (striped; the second with a padding mask), equals the unpatched single-process loop
            (fp64, ≤ 1e-9)
  patch_of  an OpenFlamingo GatedCrossAttentionBlock (its own helpers.py) patched, two steps with
            text and images sharded, equals the unpatched loop
  plan      lvx.plan equals `lvx plan --json` (LVX_BIN)
  imports   `import lvx` (a fresh interpreter) does not import torch._dynamo
  fault     (only when named) the last rank dies; the others raise a ValueError naming it
  inductor  (only when named) torch.compile with the default backend around the op equals eager
A failing check raises; the process exits non-zero and torchrun reports the rank.
"""
import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lvx

SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATEGIES = ["lv_xattn", "ring", "striped", "distflash", "ulysses", "all_gather", "lv_xattn+ring"]


def check(cond, msg):
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {msg}")


def reference(q, k, v, mask, q_media, kv_media, kv_valid):
    """fp64 SDPA on the global [B, S, H, D] tensors; rows that see no key give 0."""
    B, Sq, Hq, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    allowed = torch.ones(B, 1, Sq, Skv, dtype=torch.bool)
    if mask == "causal":
        i = torch.arange(Sq)[:, None] + (Skv - Sq)
        allowed &= torch.arange(Skv)[None, :] <= i
    elif mask in ("media_immediate", "media_upto"):
        qm, km = q_media[:, :, None], kv_media[:, None, :]
        vis = (qm == km) if mask == "media_immediate" else (km <= qm)
        allowed &= (vis & (qm >= 0) & (km >= 0))[:, None]
    if kv_valid is not None:
        allowed &= kv_valid[:, None, None, :]
    has_key = allowed.any(-1, keepdim=True)                            # [B, 1, Sq, 1]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=allowed | ~has_key, enable_gqa=True)
    return torch.where(has_key, o, torch.zeros_like(o)).transpose(1, 2)


def run_case(strategy, mask, B, Sq, Skv, Hq, Hkv, D, dtype, unit=1, padding=False, seed=0):
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Skv, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Skv, Hkv, D, generator=g, dtype=torch.float64)
    w = torch.randn(B, Sq, Hq, D, generator=g, dtype=torch.float64)
    q_media = kv_media = kv_valid = None
    if mask.startswith("media"):
        frames = Skv // unit
        kv_media = torch.arange(frames, dtype=torch.int32).repeat_interleave(unit).expand(B, -1)
        kv_media = kv_media.contiguous()
        q_media = torch.randint(-1, frames, (B, Sq), generator=g, dtype=torch.int32)
        q_media = q_media.sort(dim=1).values.contiguous()      # text time only grows
    if padding:
        kv_valid = torch.rand(B, Skv, generator=g) > 0.3
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    # The reference runs in fp64 on the very values lvx gets (rounded to dtype first).
    ref_inputs = tuple(t.double().requires_grad_() for t in (qd, kd, vd))
    ref = reference(*ref_inputs, mask, q_media, kv_media, kv_valid)
    (ref * w).sum().backward()

    sh = dict(strategy=strategy)
    ql = lvx.shard(qd.detach(), **sh).requires_grad_()
    kl = lvx.shard(kd.detach(), role="kv", unit=unit, **sh).requires_grad_()
    vl = lvx.shard(vd.detach(), role="kv", unit=unit, **sh).requires_grad_()
    kw = dict(strategy=strategy, mask=mask, q_media=q_media, kv_media=kv_media, kv_valid=kv_valid,
              q_len=Sq, kv_len=Skv, kv_unit=unit)
    lvx.reset_counters()
    o = lvx.attention(ql, kl, vl, **kw)
    (o * lvx.shard(w.to(dtype), **sh)).sum().backward()
    c = lvx.counters()
    fwd = lvx.schedule_bytes(ql, kl, vl, backward=False, **kw)
    bwd = lvx.schedule_bytes(ql, kl, vl, backward=True, **kw)
    name = f"{strategy} {mask} B={B} Sq={Sq} Skv={Skv} H={Hq}/{Hkv} {dtype} unit={unit} pad={padding}"
    check(sum(c["sent"]) == fwd[0] + bwd[0] and sum(c["received"]) == fwd[1] + bwd[1],
          f"{name}: counters sent/received {sum(c['sent'])}/{sum(c['received'])}, schedule "
          f"{fwd[0] + bwd[0]}/{fwd[1] + bwd[1]}")
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    got = {"o": lvx.unshard(o.detach(), Sq, **sh),
           "dq": lvx.unshard(ql.grad, Sq, **sh),
           "dk": lvx.unshard(kl.grad, Skv, role="kv", unit=unit, **sh),
           "dv": lvx.unshard(vl.grad, Skv, role="kv", unit=unit, **sh)}
    want = {"o": ref.detach(), "dq": ref_inputs[0].grad, "dk": ref_inputs[1].grad,
            "dv": ref_inputs[2].grad}
    for key in got:
        err = (got[key].double() - want[key]).abs().max().item()
        check(err <= tol, f"{name}: {key} differs from SDPA by {err:.3g} (tolerance {tol})")
    check(o.dtype == dtype and ql.grad.dtype == dtype, f"{name}: dtype contract broken")


def case_exact():
    n = dist.get_world_size()
    shapes = [  # mask, B, Sq, Skv, Hq, Hkv, D, unit, padding
        ("none", 2, 10, 12, 4, 2, 8, 1, False),
        ("causal", 1, 11, 11, 4, 4, 8, 1, False),
        ("causal", 2, 8, 12, 4, 2, 8, 1, False),
        ("media_immediate", 2, 10, 12, 4, 2, 8, 3, False),
        ("media_upto", 1, 9, 16, 4, 1, 8, 4, False),
        ("none", 2, 7, 12, 4, 2, 8, 1, True),
    ]
    runs = 0
    for strategy in STRATEGIES:
        for mask, B, Sq, Skv, Hq, Hkv, D, unit, pad in shapes:
            if strategy == "distflash" and not (mask == "causal" and Sq == Skv):
                continue  # causal self-attention only (its own refusal is checked in errors)
            if strategy == "ulysses" and (Hq % n or Hkv % n):
                continue  # cannot split the heads (refusal checked in errors)
            run_case(strategy, mask, B, Sq, Skv, Hq, Hkv, D, torch.float64, unit, pad)
            runs += 1
    run_case("lv_xattn", "media_immediate", 2, 10, 12, 4, 2, 8, torch.float32, 3)
    run_case("ring", "causal", 1, 11, 11, 4, 2, 8, torch.float32)
    return f"{runs + 2} calls"


def expect_error(fn, text):
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        check(text in msg, f"error message {msg!r} lacks {text!r}")
        return msg
    raise AssertionError(f"rank {dist.get_rank()}: no ValueError (expected {text!r})")


def cli_error(tensors, *args):
    """stderr of `lvx attention` on a file holding `tensors` (it must fail)."""
    from safetensors.torch import save_file
    lvx_bin = os.environ.get("LVX_BIN", os.path.join(SOURCE, "build", "lvx"))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "in.safetensors")
        save_file({k: t.clone() for k, t in tensors.items()}, path)
        # A run of its own: without torchrun's variables of this process.
        launch_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                       "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items()
               if k not in launch_vars and not k.startswith("TORCHELASTIC")}
        res = subprocess.run([lvx_bin, "attention", "--input", path, "--output",
                              os.path.join(d, "out.safetensors"), *args],
                             capture_output=True, text=True, env=env)
    check(res.returncode != 0, f"lvx attention {args} did not fail")
    return res.stderr.replace(path, "<file>")


def same_as_cli(py_msg, cli_stderr):
    """The Python message, its "lvx.attention: " prefix aside, is in what the CLI printed."""
    body = py_msg.split("lvx.attention: ", 1)[-1]
    check(body in cli_stderr, f"CLI printed {cli_stderr!r}, Python said {py_msg!r}")


def case_errors():
    n, r = dist.get_world_size(), dist.get_rank()
    q = torch.randn(1, 4, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    expect_error(lambda: lvx.attention(q[0], k, k),
                 "lvx.attention: tensor 'q' must have 4 dimensions [B, S, H, D], got [4, 4, 8]")
    msg = expect_error(lambda: lvx.attention(q, k, k[:, :3]),
                       "lvx.attention: k [1, 4, 2, 8] and v [1, 3, 2, 8] must have the same shape")
    if r == 0:
        same_as_cli(msg, cli_error({"q": q, "k": k, "v": k[:, :3]}, "--nproc", "1"))
    expect_error(lambda: lvx.attention(q, torch.randn(1, 4, 3, 8, dtype=torch.float64),
                                       torch.randn(1, 4, 3, 8, dtype=torch.float64)),
                 "lvx.attention: k has 3 heads, which does not divide q's 4 heads")
    expect_error(lambda: lvx.attention(q, k, k, mask="bogus"), "unknown mask 'bogus'")
    expect_error(lambda: lvx.attention(q, k, k, strategy="rign"), "unknown strategy 'rign'")
    expect_error(lambda: lvx.attention(q, k, k, strategy="distflash"),
                 "distflash")  # causal self-attention only
    if n >= 2:
        q5 = torch.randn(1, 4, 5, 8, dtype=torch.float64)
        msg = expect_error(lambda: lvx.attention(q5, q5, q5, strategy="ulysses"),
                           f"ulysses shards heads across ranks: 5 query heads and 5 K/V heads "
                           f"must both divide by the {n} ranks")
        if r == 0:
            q5g = torch.randn(1, 4 * n, 5, 8, dtype=torch.float64)
            same_as_cli(msg, cli_error({"q": q5g, "k": q5g, "v": q5g}, "--strategy", "ulysses",
                                       "--nproc", str(n)))
        # Shards cut for the whole group, run on a group of another size.
        sub = dist.new_group(list(range(n - 1)))
        if r < n - 1:
            S = 12
            ql = lvx.shard(torch.randn(1, S, 4, 8, dtype=torch.float64))
            expect_error(lambda: lvx.attention(ql, ql, ql, group=sub, q_len=S, kv_len=S),
                         f"lvx.attention: rank {r}'s q shard holds {ql.shape[1]} tokens, but "
                         f"lv_xattn's contiguous layout of {S} tokens over {n - 1} ranks gives "
                         f"it {lvx.positions(S, group=sub).numel()}")
        dist.barrier()
    # The op's own checks, past the Python wrapper: every enum of the spec list is range-checked
    # in C++ (an out-of-range mask kind used to run unmasked).
    spec = [1, 4 * n, 4 * n, 4, 2, 8, 0, 0, 0, 0, 1]
    for i, field, bad in ((6, "mask", 7), (7, "media_rule", -1), (8, "q_layout", 2),
                          (9, "kv_layout", 99)):
        bad_spec = list(spec)
        bad_spec[i] = bad
        expect_error(lambda: torch.ops.lvx.attention_forward(q, k, k, None, None, None, "",
                                                             "lv_xattn", bad_spec, 0.0),
                     f"lvx.attention: spec {field} = {bad} is out of range; valid: 0 (")
    bad_spec = list(spec)
    bad_spec[10] = 0
    expect_error(lambda: torch.ops.lvx.attention_forward(q, k, k, None, None, None, "",
                                                         "lv_xattn", bad_spec, 0.0),
                 "lvx.attention: spec kv_unit = 0, expected >= 1")
    return "messages match"


def case_compile():
    torch._dynamo.reset()
    results = []
    for strategy in ("lv_xattn", "ulysses" if 4 % dist.get_world_size() == 0 else "ring",
                     "all_gather"):
        g = torch.Generator().manual_seed(1)
        q = torch.randn(1, 6, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(1, 6, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(1, 6, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)

        def f(q, k, v):
            o, lse = lvx.attention(q, k, v, strategy=strategy, mask="causal", return_lse=True)
            return (o.sin() * 2).sum() + lse.sum()

        cf = torch.compile(f, fullgraph=True, backend="aot_eager")
        eager = f(q, k, v)
        ge = torch.autograd.grad(eager, (q, k, v))
        comp = cf(q, k, v)
        gc = torch.autograd.grad(comp, (q, k, v))
        err = max([(eager - comp).abs().item()] + [(a - b).abs().max().item() for a, b in zip(ge, gc)])
        check(err <= 1e-12, f"compile {strategy}: differs from eager by {err}")
        results.append(strategy)
    return "fullgraph, " + ", ".join(results)


def case_inductor():
    """The default backend (inductor) compiles a graph around the op (sin before it, relu after,
    fused by inductor) without a graph break; fp64 output and gradients equal eager's."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 16, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k):
        return (lvx.attention(q.sin(), k, k, strategy="lv_xattn", mask="causal") * 2).relu().sum()

    cf = torch.compile(f, fullgraph=True)
    y = cf(q, k)
    gc = torch.autograd.grad(y, (q, k))
    y0 = f(q, k)
    g0 = torch.autograd.grad(y0, (q, k))
    err = max([(y - y0).abs().item()] + [(a - b).abs().max().item() for a, b in zip(gc, g0)])
    check(err <= 1e-10, f"inductor: differs from eager by {err}")
    return f"fullgraph, |err| {err:.1e}"


def train_two_steps(model, batches, step_fn, parallel):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in batches:
        opt.zero_grad()
        step_fn(model, batch).backward()
        if parallel:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
        opt.step()
    return model


def max_param_diff(a, b):
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def case_patch_hf():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(cfg).double()
    S = 24
    g = torch.Generator().manual_seed(2)
    # Step 1 packed; step 2 with left padding (sample 1's first 7 tokens), as attention_mask:
    # the causal rule alone would let its later queries see them.
    batches = [(torch.randint(0, 64, (2, S), generator=g), None) for _ in range(2)]
    pad = torch.ones(2, S, dtype=torch.long)
    pad[1, :7] = 0
    batches[1] = (batches[1][0], pad)

    def labels_of(ids, am):
        lab = torch.full_like(ids, -100)
        lab[:, :-1] = ids[:, 1:]          # next-token targets, shifted once, globally
        if am is not None:
            lab[:, :-1][am[:, 1:] == 0] = -100
            lab[am == 0] = -100
        return lab

    def ref_step(model, b):
        ids, am = b
        logits = model(input_ids=ids, attention_mask=am).logits
        lab = labels_of(ids, am)
        return F.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum") / (lab >= 0).sum()

    strategy = "striped"

    def par_step(model, b):
        ids, am = b
        lab = labels_of(ids, am)
        pos = lvx.positions(S, strategy=strategy)[None].expand(ids.shape[0], -1)
        am_r = None if am is None else lvx.shard(am, strategy=strategy)
        logits = model(input_ids=lvx.shard(ids, strategy=strategy), position_ids=pos,
                       attention_mask=am_r).logits
        lab_r = lvx.shard(lab, strategy=strategy)
        return F.cross_entropy(logits.flatten(0, 1), lab_r.flatten(), reduction="sum") / (lab >= 0).sum()

    ref = train_two_steps(copy.deepcopy(base), batches, ref_step, parallel=False)
    model = copy.deepcopy(base)
    count = lvx.patch(model, self_strategy=strategy)
    check(count == 2, f"patch_hf: patched {count} modules, expected 2")
    lvx.reset_counters()
    par = train_two_steps(model, batches, par_step, parallel=True)
    routed = sum(lvx.counters()["sent"])
    check(routed > 0 or dist.get_world_size() == 1, "patch_hf: no attention went through lvx")
    err = max_param_diff(ref, par)
    moved = max_param_diff(ref, base)
    check(moved > 1e-3, "patch_hf: the reference did not train")
    check(err <= 1e-9, f"patch_hf: parameters differ from the single-process loop by {err}")
    return f"Qwen2 2 layers, {strategy}, max param diff {err:.1e}"


def load_flamingo_helpers():
    import open_flamingo
    path = os.path.join(os.path.dirname(open_flamingo.__file__), "src", "helpers.py")
    spec = importlib.util.spec_from_file_location("of_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case_patch_of():
    # open_flamingo/__init__ imports the whole model factory; only helpers.py is needed.
    spec = importlib.util.find_spec("open_flamingo")
    check(spec is not None, "open_flamingo is not installed (requirements-nodeps.txt)")
    helpers = load_flamingo_helpers()
    torch.manual_seed(0)
    base = helpers.GatedCrossAttentionBlock(dim=16, dim_visual=12, dim_head=4, heads=2,
                                            ff_mult=2, only_attend_immediate_media=True).double()
    with torch.no_grad():
        base.attn_gate.fill_(0.7)   # zero-initialised gates would hide the attention's gradients
        base.ff_gate.fill_(0.3)
    B, T, T_img, n_lat = 2, 20, 4, 3
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        x = torch.randn(B, T, 16, generator=g, dtype=torch.float64)
        media = torch.randn(B, T_img, n_lat, 12, generator=g, dtype=torch.float64)
        ml = torch.zeros(B, T, dtype=torch.bool)
        ml[0, [2, 7, 11, 15]] = True
        ml[1, [0, 5, 9, 18]] = True
        w = torch.randn(B, T, 16, generator=g, dtype=torch.float64)
        batches.append((x, media, ml, w))
    strategy = "striped"

    def ref_step(model, b):
        x, media, ml, w = b
        return (model(x, media, media_locations=ml) * w).sum()

    def par_step(model, b):
        x, media, ml, w = b
        sh = dict(strategy=strategy)
        out = model(lvx.shard(x, **sh), lvx.shard(media, dim=1, role="kv"),
                    media_locations=lvx.shard(ml, **sh))
        return (out * lvx.shard(w, **sh)).sum()

    ref = train_two_steps(copy.deepcopy(base), batches, ref_step, parallel=False)
    model = copy.deepcopy(base)
    check(lvx.patch(model, self_strategy=strategy) == 1, "patch_of: MaskedCrossAttention not found")
    lvx.reset_counters()
    par = train_two_steps(model, batches, par_step, parallel=True)
    check(sum(lvx.counters()["sent"]) > 0 or dist.get_world_size() == 1,
          "patch_of: no attention went through lvx")
    err = max_param_diff(ref, par)
    check(max_param_diff(ref, base) > 1e-3, "patch_of: the reference did not train")
    check(err <= 1e-9, f"patch_of: parameters differ from the single-process loop by {err}")
    return f"GatedCrossAttentionBlock, text {strategy} + images lv_xattn, max param diff {err:.1e}"


def case_plan():
    if dist.get_rank() != 0:
        return "rank 0 checks"
    lvx_bin = os.environ.get("LVX_BIN", os.path.join(SOURCE, "build", "lvx"))
    model = os.path.join(SOURCE, "configs/models/mplug_owl3_7b.yaml")
    cluster = os.path.join(SOURCE, "configs/clusters/a100_80g_16.yaml")
    p = lvx.plan(model, cluster, frames=256, text=2048, train=True)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "plan.json")
        cli = subprocess.run([lvx_bin, "plan", "--model", model, "--cluster", cluster, "--frames",
                              "256", "--text", "2048", "--train", "--json", out],
                             capture_output=True, text=True, check=True)
        with open(out) as f:
            want = json.load(f)
    check(p.json == want, "plan: lvx.plan's JSON differs from `lvx plan --json`")
    check(p.table == cli.stdout, "plan: lvx.plan's table differs from what `lvx plan` prints")
    expect_error(lambda: lvx.plan(model + ".missing", cluster, 8, 64), ".missing")
    return f"{len(p.layers)} layers, choices {sorted(set(p.choices))}"


def case_imports():
    """`import lvx` costs little beyond `import torch`: it must not import torch._dynamo (0.7 s;
    torch.compile loads it when used), and lvx's stand-in for assume_constant_result marks a
    function as dynamo's own decorator does."""
    if dist.get_rank() != 0:
        return "rank 0 checks"
    code = ("import sys, lvx; print(sorted(m for m in sys.modules "
            "if m == 'torch._dynamo' or m.startswith('torch._dynamo.')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ.copy(), check=True)
    check(res.stdout.strip() == "[]", f"import lvx imported {res.stdout.strip()}")

    def ours():
        pass

    def theirs():
        pass

    lvx._ops.constant_result(ours)
    torch.compiler.assume_constant_result(theirs)
    check(vars(ours) == vars(theirs) and vars(ours),
          f"constant_result marks {vars(ours)}, dynamo's decorator {vars(theirs)}")
    return "torch._dynamo not imported"


def case_fault():
    """The last rank dies before a call; the others get a ValueError naming it within the
    timeout (LVX_DIST_TIMEOUT_S, heartbeats in the group's store), and exit without hanging."""
    n, r = dist.get_world_size(), dist.get_rank()
    check(n >= 2, "fault needs 2 or more ranks")
    q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    lvx.attention(q, q, q)             # a healthy call first: the group works
    dist.barrier()
    if r == n - 1:
        os._exit(0)                    # dies without a word
    import time
    t0 = time.monotonic()
    msg = expect_error(lambda: lvx.attention(q, q, q), f"rank {n - 1} stopped responding")
    took = time.monotonic() - t0
    limit = float(os.environ.get("LVX_DIST_TIMEOUT_S", "60")) + 10
    check(took < limit, f"fault: reported after {took:.1f} s (limit {limit} s)")
    print(f"[rank {r}] fault: ok ({took:.1f} s): {msg}", flush=True)
    os._exit(0)                        # the group is broken: no orderly teardown


CASES = {"exact": case_exact, "errors": case_errors, "compile": case_compile,
         "patch_hf": case_patch_hf, "patch_of": case_patch_of, "plan": case_plan,
         "fault": case_fault, "inductor": case_inductor, "imports": case_imports}
DEFAULT = ["exact", "errors", "compile", "patch_hf", "patch_of", "plan", "imports"]


def main():
    dist.init_process_group("gloo")
    names = sys.argv[1:] or DEFAULT
    for name in names:
        summary = CASES[name]()
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"[{dist.get_world_size()} ranks] {name}: ok ({summary})", flush=True)
    lvx.reset_counters()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
