"""Reference media masks for tests/test_attention_media.cpp, from the models' own mask code.

usage: media_mask_ref.py INPUT OUTPUT

INPUT (safetensors) holds, per case C: "C.input_ids" int64 [B, L] and "C.meta" int64
[media_token_id, tokens_per_media, slots]. OUTPUT gets, per case and rule R, "C.R" bool
[B, L, slots * tokens_per_media]: True where text token t of sample b attends to visual key j
(the visual tokens of the sample's images concatenated in image order; slots a sample does not
have are never attended).

OpenFlamingo: the package's own code runs (open-flamingo==2.0.1, open_flamingo/src/helpers.py
MaskedCrossAttention.forward, loaded by file path so that open_flamingo/__init__.py and its
open_clip/transformers imports are not needed). Visibility is read off its attention weights:
one head, every query q = e0, key j = (j + 1) * e0 (distinct logits), value j = e_j, identity
output projection, so output row t IS the attention row of t. A key is visible iff its weight
is > 0. One package quirk: with only_attend_immediate_media=False a row with no visible key is
not zeroed, so its softmax over all-masked logits comes out uniform over every key; a uniform
row cannot come from distinct logits over visible keys (with >= 2 keys), so it is read as
"sees nothing", which is what the package's mask (text_to_media_mask) says.

mPLUG-Owl3 has no package: the lines marked VERBATIM are the released code transcribed as
PyTorch: 240728 processing_mplugowl3.py MediaIndicesHelper.cal_media_offset and encode_text_sft
(from a PyTorch copy of the file; the batch offsets as ms-swift's collation adds them), x_sdpa.py's
inversion `attn_mask = ~attn_mask` (PyTorch copy); 240728 modeling_hyper_qwen2.py make_t2v_mask,
select_query and the mask lines of HyperQwen2Attention.crossattention, and 241101
modeling_hyper_qwen2.py hyperattention's t2vmask, read in line-by-line Paddle ports of those
files (PaddleMIX; the 240728 port keeps the torch lines as comments) and written back as PyTorch
calls with the same operators. Only the loops that place the per-sample masks into one dense
tensor are ours.
"""
import importlib.util
import os
import sys

import torch
from einops import repeat
from safetensors.torch import load_file, save_file

STATS = {"openflamingo rows with all logits masked": 0, "240728 samples whose only images are last": 0}
RULES = ("openflamingo", "openflamingo-all-previous", "mplug-owl3-240728", "mplug-owl3-241101")


# ---- OpenFlamingo: the package's own MaskedCrossAttention ------------------------------------
def load_openflamingo_helpers():
    spec = importlib.util.find_spec("open_flamingo")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("open_flamingo is not installed (setup.sh installs open-flamingo==2.0.1 --no-deps)")
    path = os.path.join(spec.submodule_search_locations[0], "src", "helpers.py")
    mod_spec = importlib.util.spec_from_file_location("open_flamingo_helpers", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def openflamingo_visibility(helpers, input_ids, media_token_id, n, slots, immediate):
    B, L = input_ids.shape
    K = slots * n
    if K == 0:
        return torch.zeros(B, L, 0, dtype=torch.bool)
    assert K >= 2, "reading visibility off attention weights needs >= 2 keys"
    xattn = helpers.MaskedCrossAttention(dim=K, dim_visual=K, dim_head=K, heads=1,
                                         only_attend_immediate_media=immediate).double()
    with torch.no_grad():
        xattn.norm.weight.zero_()  # LayerNorm(x) = bias = ones: the same query for every token
        xattn.norm.bias.fill_(1.0)
        xattn.to_q.weight.zero_()
        xattn.to_q.weight[0, 0] = 1.0  # q = e0
        w_kv = torch.zeros(2 * K, K, dtype=torch.float64)
        w_kv[0] = torch.arange(1, K + 1, dtype=torch.float64)  # k_j = (j + 1) e0: distinct logits
        w_kv[K:] = torch.eye(K, dtype=torch.float64)  # v_j = e_j
        xattn.to_kv.weight.copy_(w_kv)
        xattn.to_out.weight.copy_(torch.eye(K, dtype=torch.float64))
        x = torch.randn(B, L, K, dtype=torch.float64)
        media = torch.eye(K, dtype=torch.float64).reshape(1, slots, n, K).expand(B, -1, -1, -1)
        media_locations = input_ids == media_token_id
        attn = xattn(x, media, media_locations=media_locations)  # [B, L, K] = attention rows
    uniform = (attn == attn[..., :1]).all(-1, keepdim=True)  # all-masked row, see header
    STATS["openflamingo rows with all logits masked"] += int((uniform & (attn[..., :1] > 0)).sum())
    return (attn > 0) & ~uniform


# ---- mPLUG-Owl3 240728: processor offsets and make_t2v_mask ---------------------------------
def cal_media_offset(media_position, input_ids):
    # VERBATIM 240728 processing_mplugowl3.py, MediaIndicesHelper.cal_media_offset (self.
    # media_position passed in): media_position[i] = [start, end] of the i-th `<|image|>`.
    if len(media_position) == 0:
        return torch.ones_like(input_ids)*(-1000000)

    media_starts = torch.tensor([_[0] for _ in media_position]).reshape(1,-1)
    rng = torch.arange(input_ids.shape[0]).reshape(-1,1)
    matrix = (rng > media_starts).sum(dim=1)

    return matrix


def batch_media_offset(input_ids, media_token_id):
    # Processor encode_text_sft (`[media_before, mo + media_before]`, [L, 2] per sample), batched
    # as ms-swift's collation does: media_before = images of the preceding samples.
    rows, media_before = [], 0
    for ids in input_ids:
        media_position = [[p, p + 1] for p in (ids == media_token_id).nonzero().flatten().tolist()]
        mo = cal_media_offset(media_position, ids)
        rows.append(torch.cat([(torch.ones(mo.shape[0],1)*media_before).long().to(mo.device), (mo+media_before).unsqueeze(1)], dim=1)) # L 2
        media_before += len(media_position)
    return torch.stack(rows, dim=0)  # [B, L, 2]


def make_t2v_mask(media_offset_line, num_images):
    # VERBATIM 240728 modeling_hyper_qwen2.py (True = masked).
    assert len(media_offset_line.shape) == 1
    media_offset_line = media_offset_line.view(-1,1)
    visual_arange = torch.arange(num_images).view(1,-1)
    mask = media_offset_line <= visual_arange
    return mask


def select_query(media_offset, num_queries=None):
    # VERBATIM 240728 modeling_hyper_qwen2.py.
    query_indices = media_offset[:,:,1]>=0
    assert query_indices.sum().item()%num_queries == 0, query_indices.sum().item()
    query_indices = query_indices.nonzero()
    ptr = 0
    while ptr < query_indices.shape[0]:
        first_query_index, last_query_index = query_indices[ptr], query_indices[ptr+num_queries-1]
        assert (last_query_index[1] - first_query_index[1] + 1).item() == num_queries
        assert last_query_index[0].item() == first_query_index[0].item()
        batch_id, begin_i, end_i = first_query_index[0].item(), first_query_index[1].item(), first_query_index[1].item()+num_queries
        yield batch_id, begin_i, end_i
        ptr += num_queries


def mplug_240728_visibility(input_ids, media_token_id, n, slots):
    B, L = input_ids.shape
    vis = torch.zeros(B, L, slots * n, dtype=torch.bool)
    media_offset = batch_media_offset(input_ids, media_token_id)
    length_each_img, sequence_length = n, L
    for batch_id, begin_i, end_i in select_query(media_offset, sequence_length):
        # VERBATIM HyperQwen2Attention.crossattention, prefill branch (not completion_flag):
        curr_offset = media_offset[batch_id, end_i-1]
        re_to_zero_media_offset = (media_offset[batch_id, :, 1] - curr_offset[0])
        try:
            query_shift = re_to_zero_media_offset.nonzero()[0].item()
        except IndexError:
            # The sample's only images sit at the last position: no token comes after one, the
            # released code raises here (`nonzero()[0]` of an empty tensor). No query would get
            # cross-attention; record none.
            STATS["240728 samples whose only images are last"] += 1
            continue
        curr_mask = make_t2v_mask(re_to_zero_media_offset[query_shift:], num_images=curr_offset[1]-curr_offset[0])
        curr_mask = repeat(curr_mask, 's_q s_k -> B H s_q (s_k img_l)', B=1, H=1, img_l=length_each_img)
        # x_sdpa.py ScaleDotProductAttention.forward: `attn_mask = (~attn_mask.clone().bool())`,
        # True = takes part. Queries before query_shift are not in the cross-attention at all.
        attend = ~curr_mask.clone().bool()
        vis[batch_id, query_shift:, : attend.shape[-1]] = attend[0, 0]
    return vis


# ---- mPLUG-Owl3 241101: fused hyperattention's t2vmask ---------------------------------------
def mplug_241101_visibility(input_ids, media_token_id, n, slots):
    B, L = input_ids.shape
    vis = torch.zeros(B, L, slots * n, dtype=torch.bool)
    # media_offset is a list of `<|image|>` positions per sample (241101 "Adjusted media_offset").
    media_offset = [(ids == media_token_id).nonzero().flatten() for ids in input_ids]
    length_each_img, q_len = n, L
    for bi, media_starts in enumerate(media_offset):
        num_images = media_starts.shape[0]
        if num_images > 0:
            # VERBATIM 241101 hyperattention, prefill (q_len > 1); True = takes part:
            matrix = torch.arange(q_len).reshape(-1, 1)
            t2vmask = ~(matrix < media_starts.reshape(1, -1))
            t2vmask = repeat(t2vmask, "seq_t seq_v -> 1 1 seq_t (seq_v v_token)", v_token=length_each_img)
            vis[bi, :, : t2vmask.shape[-1]] = t2vmask[0, 0]
        # else: plain causal attention, no visual keys.
    return vis


def main():
    inp, out = sys.argv[1:3]
    cases = load_file(inp)
    helpers = load_openflamingo_helpers()
    torch.manual_seed(0)
    result = {}
    for name in sorted({k.split(".")[0] for k in cases}):
        ids = cases[name + ".input_ids"]
        media_token_id, n, slots = (int(v) for v in cases[name + ".meta"])
        result[name + ".openflamingo"] = openflamingo_visibility(helpers, ids, media_token_id, n,
                                                                 slots, immediate=True)
        result[name + ".openflamingo-all-previous"] = openflamingo_visibility(
            helpers, ids, media_token_id, n, slots, immediate=False)
        result[name + ".mplug-owl3-240728"] = mplug_240728_visibility(ids, media_token_id, n, slots)
        result[name + ".mplug-owl3-241101"] = mplug_241101_visibility(ids, media_token_id, n, slots)
    save_file({k: v.contiguous() for k, v in result.items()}, out)
    print(f"wrote {len(result)} masks for {len(result) // len(RULES)} cases; {STATS}")


if __name__ == "__main__":
    main()
