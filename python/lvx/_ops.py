"""Loads lvx's operator library and registers what torch needs around it.

The operators themselves are C++ (python/csrc/ops.cpp, TORCH_LIBRARY "lvx"). Here: their fake
kernels (shapes only, so torch.compile and meta tensors can trace them without running any
communication) and the autograd formula of ``lvx::attention_forward`` (its backward is
``lvx::attention_backward``, the strategy's own distributed backward).
"""
import atexit
import functools
import glob
import os

import torch

_LIBRARY_ENV = "LVX_OPS_LIBRARY"


def _library_path():
    path = os.environ.get(_LIBRARY_ENV)
    if path:
        if not os.path.isfile(path):
            raise ImportError(f"{_LIBRARY_ENV}={path}: no such file (build the lvx_torch_ops target)")
        return path
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_lvx_ops*.so")))
    if not found:
        raise ImportError(
            "lvx's operator library (_lvx_ops.so) is not installed next to the package: "
            "`pip install --no-build-isolation ./python` builds it, or point "
            f"{_LIBRARY_ENV} at <build>/python/lvx/_lvx_ops.so")
    return found[0]


torch.ops.load_library(_library_path())
ops = torch.ops.lvx
# lvx's groups run on torch.distributed's engines: end them before those (and the interpreter) go.
atexit.register(lambda: ops.release_groups())


@functools.lru_cache(maxsize=None)
def saved_form(strategy):
    """What the forward of `strategy` ("S" or "F+B") saves beyond q, k, v, o, lse."""
    return ops.saved_form(strategy)


def constant_result(fn):
    """``torch.compiler.assume_constant_result`` without its cost at import time: that function
    imports ``torch._dynamo`` (0.7 s, most of ``import lvx``) only to set the mark below, which
    dynamo reads when it traces a call of `fn`. tests/python/test_lvx.py (case imports) checks
    that dynamo's decorator sets the same mark and that ``import lvx`` leaves dynamo unloaded;
    the compile cases check that the traced calls stay constants (no graph break)."""
    fn._dynamo_marked_constant = True
    return fn


# The group's size and name are fixed for the life of the group: traced as constants, so
# torch.compile(fullgraph=True) does not break on the c10d lookups.
@constant_result
def _world(group):
    if not group:
        return 1
    return torch.distributed.distributed_c10d._resolve_process_group(group).size()


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("lvx::attention_forward")
def _attention_forward_fake(q, k, v, q_media, kv_media, kv_valid, group, strategy, spec, scale):
    B, Sq, Skv, Hq, Hkv, D = spec[:6]
    acc = _acc_dtype(q.dtype)
    o = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc)
    form = saved_form(strategy)
    if form == "gathered_kv":
        extra = [k.new_empty((B, Skv, Hkv, D)), v.new_empty((B, Skv, Hkv, D))]
    elif form == "head_shards":
        n = _world(group)
        extra = [q.new_empty((B, Sq, Hq // n, D)), k.new_empty((B, Skv, Hkv // n, D)),
                 v.new_empty((B, Skv, Hkv // n, D)), q.new_empty((B, Sq, Hq // n, D)),
                 q.new_empty((B, Hq // n, Sq), dtype=acc)]
    else:
        extra = []
    return o, lse, extra


@torch.library.register_fake("lvx::attention_backward")
def _attention_backward_fake(dout, dlse, q, k, v, o, lse, extra, q_media, kv_media, kv_valid,
                             group, strategy, spec, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, q_media, kv_media, kv_valid, group, strategy, spec, scale = inputs
    o, lse, extra = output
    # Exactly what the C++ autograd function keeps: the shards, O, lse and the strategy's extra
    # state; the mask metadata is global and small.
    ctx.save_for_backward(q, k, v, o, lse, *extra)
    ctx.masks = (q_media, kv_media, kv_valid)
    ctx.args = (group, strategy, spec, scale)
    # An unused lse gets no gradient (None), so the backward does not fold a zero into delta
    # (for ulysses that would cost one more all-to-all).
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse, dextra):
    q, k, v, o, lse, *extra = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(o)
    group, strategy, spec, scale = ctx.args
    dq, dk, dv = ops.attention_backward(dout.contiguous(), dlse, q, k, v, o, lse, extra,
                                        *ctx.masks, group, strategy, spec, scale)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("lvx::attention_forward", _backward, setup_context=_setup_context)
