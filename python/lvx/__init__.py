"""lvx from PyTorch: exact distributed attention as an autograd op on torch.distributed groups.

    import torch.distributed as dist, lvx
    dist.init_process_group("gloo")          # or "nccl", or "cpu:gloo,cuda:nccl"
    q = lvx.shard(q_global, role="q")        # this rank's tokens, [B, S_r, H, D]
    k, v = lvx.shard(k_global, role="kv"), lvx.shard(v_global, role="kv")
    o = lvx.attention(q, k, v, strategy="lv_xattn")   # this rank's rows of softmax(QKᵀ)V

Every strategy of the C++ runtime (lv_xattn, ring, striped, distflash, ulysses, all_gather, and
forward+backward pairs such as "lv_xattn+ring") computes exactly the attention of the gathered
tensors, forward and backward, and sends exactly the bytes its C++ twin sends (``counters``).
Errors are ``ValueError`` with the CLI's message. The op is a torch custom op with fake kernels,
so ``torch.compile(fullgraph=True)`` traces through it without a graph break.
"""
import json as _json

import torch
import torch.distributed as _dist

from . import _ops
from ._ops import ops as _C

__all__ = ["attention", "shard", "unshard", "positions", "counters", "reset_counters",
           "schedule_bytes", "plan", "Plan", "patch"]

_MASKS = {"none": (0, 0), "causal": (1, 0), "media_immediate": (2, 0), "media_upto": (2, 1)}
_LAYOUTS = {"contiguous": 0, "striped": 1}


@_ops.constant_result
def _group_name(group):
    """The c10d registry name of `group` (None: the default group; "" when there is none)."""
    if group is None:
        if not _dist.is_available() or not _dist.is_initialized():
            return ""
        group = _dist.distributed_c10d._get_default_group()
    return group.group_name


def _world_rank(group):
    if _group_name(group) == "":
        return 1, 0
    return _dist.get_world_size(group), _dist.get_rank(group)


def _spec(q, k, v, name, mask, q_media, kv_media, kv_valid, q_len, kv_len, kv_unit, q_layout,
          kv_layout):
    """The op's spec list (global lengths, mask, layouts; see python/csrc/ops.cpp)."""
    mask = "none" if mask is None else mask
    if mask not in _MASKS:
        raise ValueError(f"lvx.attention: unknown mask '{mask}' (valid: {', '.join(_MASKS)})")
    if (q_media is not None or kv_media is not None) and not mask.startswith("media"):
        raise ValueError("lvx.attention: q_media/kv_media given, but mask is "
                         f"'{mask}' (use media_immediate or media_upto)")
    for tname, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"lvx.attention: tensor '{tname}' must have 4 dimensions "
                             "[B, S, H, D], got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t)}")
    world = _ops._world(name)
    if q_len is None:
        q_len = q_media.shape[1] if q_media is not None else q.shape[1] * world
    if kv_len is None:
        if kv_media is not None:
            kv_len = kv_media.shape[1]
        elif kv_valid is not None:
            kv_len = kv_valid.shape[1]
        else:
            kv_len = k.shape[1] * world
    kind, rule = _MASKS[mask]
    spec = [q.shape[0], int(q_len), int(kv_len), q.shape[2], k.shape[2], q.shape[3], kind, rule,
            _LAYOUTS[q_layout], _LAYOUTS[kv_layout], int(kv_unit)]
    return spec


def schedule_bytes(q, k, v, *, strategy="lv_xattn", group=None, backward=False, mask=None,
                   q_media=None, kv_media=None, kv_valid=None, q_len=None, kv_len=None, kv_unit=1,
                   q_layout="contiguous", kv_layout="contiguous"):
    """(sent, received): the bytes this rank's messages carry in one pass of ``attention`` with
    these arguments, from the strategy's schedule (what ``counters`` measures; the C++ tests and
    the planner use the same schedule)."""
    name = _group_name(group)
    spec = _spec(q, k, v, name, mask, q_media, kv_media, kv_valid, q_len, kv_len, kv_unit,
                 q_layout, kv_layout)
    sent, received = _C.schedule_bytes(name, strategy, spec, q.dtype, backward)
    return sent, received


def attention(q, k, v, *, strategy="lv_xattn", group=None, mask=None, q_media=None,
              kv_media=None, kv_valid=None, scale=None, q_len=None, kv_len=None, kv_unit=1,
              q_layout="contiguous", kv_layout="contiguous", return_lse=False):
    """Exact attention over the sequences sharded across `group`, on this rank's shards.

    q: [B, Sq_r, Hq, D], k/v: [B, Skv_r, Hkv, D] (Hkv dividing Hq: MHA, GQA, MQA), this rank's
    tokens in the strategy's layout (``shard(..., strategy=)`` cuts them). Returns this rank's
    rows of the output, [B, Sq_r, Hq, D] in q's dtype (and the log-sum-exp [B, Hq, Sq_r] in fp32,
    fp64 for fp64 inputs, with ``return_lse=True``; −inf for a row that sees no key, whose output
    is 0). Differentiable in q, k and v through the strategy's distributed backward.

    mask: None/"none", "causal" (global positions; Sq ≠ Skv aligns the last query with the last
    key), "media_immediate" (OpenFlamingo: a query sees the keys of its latest media) or
    "media_upto" (mPLUG-Owl3: every media up to its latest). q_media int32 [B, Sq] and kv_media
    int32 [B, Skv] are global (every rank passes the whole metadata); kv_valid bool [B, Skv]
    marks padding keys (False). q_len/kv_len: the global lengths, needed only for uneven shards
    when no global metadata gives them (default: the shard length times the group size).
    """
    name = _group_name(group)
    spec = _spec(q, k, v, name, mask, q_media, kv_media, kv_valid, q_len, kv_len, kv_unit,
                 q_layout, kv_layout)
    o, lse, _ = _C.attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), q_media,
                                     kv_media, kv_valid, name, strategy, spec,
                                     0.0 if scale is None else float(scale))
    return (o, lse) if return_lse else o


def positions(total, *, group=None, strategy="lv_xattn", role="q", unit=1, rank=None):
    """int64 [S_r]: the global index of each of this rank's tokens (for position ids, labels)."""
    world, me = _world_rank(group)
    return _C.shard_positions(strategy, role, int(total), world, me if rank is None else rank,
                              int(unit))


def shard(x, *, dim=1, group=None, strategy="lv_xattn", role="q", unit=1):
    """This rank's tokens of the global tensor `x` (token dimension `dim`) under the layout the
    strategy uses for `role` ("q": queries, outputs, position ids, labels; "kv": keys, values,
    visual features, split in whole blocks of `unit` tokens, e.g. one image's tokens)."""
    idx = positions(x.shape[dim], group=group, strategy=strategy, role=role, unit=unit)
    return x.index_select(dim, idx.to(x.device))


def unshard(x, total, *, dim=1, group=None, strategy="lv_xattn", role="q", unit=1):
    """Inverse of ``shard`` over the group: every rank gets the global tensor (an all-gather
    through torch.distributed, not counted by ``counters``). Not differentiable."""
    world, _ = _world_rank(group)
    if world == 1:
        return x
    idx = [positions(total, group=group, strategy=strategy, role=role, unit=unit, rank=r)
           for r in range(world)]
    xt = x.movedim(dim, 0).contiguous()
    pad = torch.zeros((max(i.numel() for i in idx),) + tuple(xt.shape[1:]), dtype=x.dtype,
                      device=x.device)
    pad[: xt.shape[0]] = xt
    parts = [torch.empty_like(pad) for _ in range(world)]
    _dist.all_gather(parts, pad, group=group)
    out = torch.empty((total,) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
    for r in range(world):
        out[idx[r].to(x.device)] = parts[r][: idx[r].numel()]
    return out.movedim(0, dim)


def counters(group=None):
    """Bytes lvx's messages on `group` sent to and received from each peer since the last
    reset (the C++ ByteCounters), and the seconds spent waiting for them."""
    t, wait = _C.counters(_group_name(group))
    return {"sent": t[0].tolist(), "received": t[1].tolist(), "wait_seconds": wait}


def reset_counters(group=None):
    _C.reset_counters(_group_name(group))


class Plan:
    """`lvx plan`'s result: ``table`` (what the CLI prints), ``layers`` (per layer: kind, shapes,
    ``choice``, predicted costs of every strategy, the explanation) and the whole ``json``."""

    def __init__(self, table, plan_json):
        self.table = table
        self.json = _json.loads(plan_json)
        self.layers = self.json["layers"]

    @property
    def choices(self):
        return [layer["choice"] for layer in self.layers]

    def __str__(self):
        return self.table


def plan(model_config, cluster, frames, text, *, tokens_per_frame=0, nproc=0, dtype="",
         train=False, layout="video_qa", strategies=()):
    """The planner's per-layer strategy choice (``lvx plan``): model_config is a model YAML
    (configs/models/) or a checkpoint directory, cluster a cluster YAML (configs/clusters/)."""
    table, js = _C.plan(str(model_config), str(cluster), int(frames), int(text),
                        int(tokens_per_frame), int(nproc), dtype, bool(train), layout,
                        list(strategies))
    return Plan(table, js)


from .patch import patch  # noqa: E402  (needs attention above)
