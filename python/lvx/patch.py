"""One call to run an existing PyTorch model's attention sequence-parallel through lvx.

    model = transformers.AutoModelForCausalLM.from_pretrained(...)   # or an OpenFlamingo model
    lvx.patch(model)                        # default group; self "striped", cross "lv_xattn"
    ids = lvx.shard(input_ids, strategy="striped")                    # this rank's tokens
    pos = lvx.positions(input_ids.shape[1], strategy="striped")[None]
    logits = model(input_ids=ids, position_ids=pos).logits            # this rank's rows

What it routes:
- self-attention of transformers models that use the attention-function interface (Qwen2 — the
  language model of mPLUG-Owl3 —, Llama, Mistral, …): registered as attention implementation
  "lvx" and selected on the model; causal over global positions. The text is sharded once, in
  the self strategy's layout, for every layer; the model sees only its rows, so position ids
  must be passed (``lvx.positions``). A padding mask (``attention_mask``, this rank's shard of
  it) marks padding keys for every rank (one all-gather of the boolean mask per forward). Several
  sequences packed into one row are not told apart: the row is one causal sequence.
- OpenFlamingo's MaskedCrossAttention (open_flamingo.src.helpers): text shards attend to the
  media shards of every rank with the OpenFlamingo media mask; media_locations is this rank's
  shard (same layout as the text), media this rank's whole images (``lvx.shard(media,
  role="kv")`` on the image axis). The global media times come from one all-gather of the
  boolean media_locations through torch.distributed. Cached media (generation) is refused.
  Rows before the first media get 0, as OpenFlamingo gives them in its default
  (only_attend_immediate_media) mode; in its all-previous mode OpenFlamingo averages every
  image's values there (a side effect of its −max fill), which lvx does not copy.
Gradients flow through the strategies' distributed backward; data-parallel reduction of the
parameter gradients stays the training loop's job (every rank holds the whole model).
"""
import torch
import torch.distributed as dist

from . import attention, unshard

_IMPL = "lvx"
_registered = False


def _options(module):
    opt = getattr(module, "lvx_options", None)
    if opt is None:
        raise ValueError(f"lvx: {type(module).__name__} uses attention implementation 'lvx' "
                         "but was not patched (call lvx.patch(model))")
    return opt


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kwargs):
    """transformers' attention-function interface: query [B, H, S_r, D] → ([B, S_r, H, D], None)."""
    opt = _options(module)
    if dropout:
        raise ValueError(f"lvx: attention dropout {dropout} is not supported (set "
                         "attention_dropout=0)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("lvx: sliding-window attention is not supported")
    causal = getattr(module, "is_causal", True)
    kv_valid = _global_padding(opt, attention_mask)
    o = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                  strategy=opt["self_strategy"], group=opt["group"],
                  mask="causal" if causal else None, scale=scaling, kv_valid=kv_valid)
    return o, None


def _hf_mask(batch_size=None, cache_position=None, kv_length=None, kv_offset=0,
             mask_function=None, attention_mask=None, **kwargs):
    """transformers' mask interface for "lvx": the 2D padding mask of this rank's tokens as
    given (bool [B, S_r]) or None; the causal rule is lvx's, over global positions."""
    return attention_mask


def _global_padding(opt, mask):
    """Every rank's padding mask in global token order (bool [B, S]; None without padding),
    gathered once per forward (every layer gets the same mask object) through torch.distributed."""
    if mask is None:
        return None
    if mask.dim() != 2:
        raise ValueError(f"lvx: expected a 2D padding mask [B, S_r], got {list(mask.shape)}")
    cached = opt.get("_padding")
    if cached is not None and cached[0] is mask:
        return cached[1]
    group = opt["group"]
    total = torch.tensor([mask.shape[1]], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    glob = unshard(mask.to(torch.uint8), int(total), group=group,
                   strategy=opt["self_strategy"]).bool().contiguous()
    glob = None if bool(glob.all()) else glob
    opt["_padding"] = (mask, glob)
    return glob


def _register_hf():
    global _registered
    if _registered:
        return True
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register(_IMPL, _hf_attention)
    AttentionMaskInterface.register(_IMPL, _hf_mask)
    _registered = True
    return True


def _flamingo_forward(self, x, media, media_locations=None, use_cached_media=False):
    """MaskedCrossAttention.forward on this rank's text and media shards (see module doc)."""
    opt = _options(self)
    if use_cached_media:
        raise ValueError("lvx: OpenFlamingo's cached media (generation) is not supported by the "
                         "sequence-parallel patch")
    if media_locations is None:
        raise ValueError("lvx: OpenFlamingo cross-attention needs media_locations")
    group, layout_strategy = opt["group"], opt["self_strategy"]
    B, T_r = x.shape[:2]
    _, T_img_r, n = media.shape[:3]
    h = self.heads
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    # Global text length and image count (tiny collectives, through torch.distributed).
    sizes = torch.tensor([T_r, T_img_r], dtype=torch.int64, device=x.device)
    if world > 1:
        dist.all_reduce(sizes, group=group)
    T, T_img = int(sizes[0]), int(sizes[1])
    ml = unshard(media_locations.to(torch.uint8), T, group=group, strategy=layout_strategy)
    q_media = ml.to(torch.int32).cumsum(dim=1, dtype=torch.int32)          # text time, 1-based
    kv_media = (torch.arange(T_img, device=x.device, dtype=torch.int32) + 1).repeat_interleave(n)
    kv_media = kv_media.expand(B, -1).contiguous()
    xn = self.norm(x)
    q = self.to_q(xn).view(B, T_r, h, -1)
    k, v = self.to_kv(media.flatten(1, 2)).chunk(2, dim=-1)
    k = k.reshape(B, T_img_r * n, h, -1)
    v = v.reshape(B, T_img_r * n, h, -1)
    text_layout = "striped" if "striped" in layout_strategy else "contiguous"
    o = attention(q, k, v, strategy=opt["cross_strategy"], group=group,
                  mask="media_immediate" if self.only_attend_immediate_media else "media_upto",
                  q_media=q_media, kv_media=kv_media, kv_unit=n, scale=self.scale,
                  q_layout=text_layout)
    return self.to_out(o.reshape(B, T_r, -1))


def _is_flamingo_cross_attention(m):
    # By shape, not by import: open_flamingo's package __init__ pulls in open_clip and
    # transformers, and users vendor helpers.py; the forward replaced is the same.
    return type(m).__name__ == "MaskedCrossAttention" and all(
        hasattr(m, a) for a in ("to_q", "to_kv", "to_out", "norm", "heads",
                                "only_attend_immediate_media"))


def patch(model, *, group=None, self_strategy="striped", cross_strategy="lv_xattn"):
    """Routes `model`'s attention through ``lvx.attention`` on `group` (None: the default group).

    Returns the number of attention modules patched; raises ValueError when it finds none it
    supports. self_strategy also fixes the text layout (striped or contiguous) of every layer,
    cross-attention queries included, so shard the text with ``strategy=self_strategy``.
    """
    opts = {"group": group, "self_strategy": self_strategy, "cross_strategy": cross_strategy}
    count = 0
    uses_hf = hasattr(getattr(model, "config", None), "_attn_implementation")
    for m in model.modules():
        if _is_flamingo_cross_attention(m):
            m.lvx_options = opts
            m.forward = _flamingo_forward.__get__(m)
            count += 1
        elif uses_hf and type(m).__name__.endswith("Attention") and hasattr(m, "config"):
            m.lvx_options = opts
            count += 1
    if uses_hf and count:
        if not _register_hf():
            raise ValueError("lvx.patch: transformers is not importable")
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(_IMPL)
        else:
            model.config._attn_implementation = _IMPL
    if count == 0:
        raise ValueError(f"lvx.patch: no attention module lvx supports in {type(model).__name__} "
                         "(transformers models with the attention-function interface, "
                         "OpenFlamingo's MaskedCrossAttention)")
    return count

