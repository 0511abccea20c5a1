"""The library a user would otherwise run, on lvx init-model's release-shaped checkpoints, for
bench_real_size.py: transformers' MllamaForConditionalGeneration (Llama-3.2-Vision) and
open_flamingo's Flamingo (OpenFlamingo), greedy generation with the KV cache.

  real_size_peer.py make-batch mllama|openflamingo MODEL_DIR BATCH.safetensors
  real_size_peer.py run mllama|openflamingo MODEL_DIR BATCH.safetensors OUT.safetensors
        [--dtype fp32|bf16] [--tokens 16]

make-batch: Mllama: one image of 2 × 2 tiles (560 px each), its <|image|> after <|begin_of_text|>,
128 tokens, the cross-attention mask as MllamaProcessor builds it; OpenFlamingo: 4 images of
224 px in its interleaved format (openflamingo_ref.py's make_batch), 128 tokens. The same file is
lvx forward's input.
run: prints one JSON line {"peer", "prefill_s", "decode_ms_per_token", "tokens"}: prefill is the
time to the first new token, decode the time per later token (a stopping criterion timestamps
every step of generate()), and writes the tokens.
"""
import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import load_file, save_file

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SOURCE, "tests", "reference"))


def make_batch(kind, model_dir, batch_file):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    g = torch.Generator().manual_seed(0)
    if kind == "openflamingo":
        import openflamingo_ref
        b = openflamingo_ref.make_batch(cfg, 1, 1, 128, 4)
        b.pop("labels")
        save_file(b, batch_file)
        return
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense, get_cross_attention_token_mask)
    tok = json.load(open(os.path.join(model_dir, "tokenizer.json")))
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    image_id, L = cfg["image_token_index"], 128
    vc = cfg["vision_config"]
    S, tiles = vc["image_size"], vc["max_num_tiles"]
    words = len(tok["model"]["vocab"])
    ids = torch.randint(0, words, (1, L), generator=g)
    ids[0, 0] = special["<|begin_of_text|>"]
    ids[0, 1] = image_id
    ratio = [2, 2]
    pv = torch.zeros(1, 1, tiles, 3, S, S)
    pv[0, 0, :4] = torch.rand(4, 3, S, S, generator=g) * 2 - 1
    ar_ids = torch.tensor([[vc["supported_aspect_ratios"].index(ratio) + 1]])
    ar_mask = torch.zeros(1, 1, tiles, dtype=torch.int64)
    ar_mask[0, 0, :4] = 1
    cam = torch.from_numpy(convert_sparse_cross_attention_mask_to_dense(
        [get_cross_attention_token_mask(ids[0].tolist(), image_id)], [[4]], tiles, L))
    save_file({"input_ids": ids, "pixel_values": pv, "aspect_ratio_ids": ar_ids,
               "aspect_ratio_mask": ar_mask, "cross_attention_mask": cam.contiguous()}, batch_file)


class Clock:
    """A stopping criterion that only records when each generation step ends."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kw):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run(kind, model_dir, batch_file, out, dtype, tokens):
    from transformers import StoppingCriteriaList
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    b = load_file(batch_file)
    clock = Clock()
    gen = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, num_beams=1,
               use_cache=True, stopping_criteria=StoppingCriteriaList([clock]))
    if kind == "mllama":
        from transformers import MllamaForConditionalGeneration
        model = MllamaForConditionalGeneration.from_pretrained(model_dir, torch_dtype=dt).eval()
        ids = b["input_ids"]
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  pixel_values=b["pixel_values"].to(dt), aspect_ratio_ids=b["aspect_ratio_ids"],
                  aspect_ratio_mask=b["aspect_ratio_mask"],
                  cross_attention_mask=b["cross_attention_mask"])
        name = "transformers MllamaForConditionalGeneration"
        with torch.inference_mode():
            t0 = time.perf_counter()
            new = model.generate(**kw, **gen)[:, ids.shape[1]:]
    else:
        import openflamingo_ref
        model, cfg, _ = openflamingo_ref.build_from_converted(model_dir)
        model = model.to(dt).eval()
        ids = b["input_ids"]
        vx = openflamingo_ref.vision_x_of(b).to(dt)
        name = "open_flamingo Flamingo"
        with torch.inference_mode(), openflamingo_ref.default_dtype(dt):
            t0 = time.perf_counter()
            new = model.generate(vx, ids, attention_mask=torch.ones_like(ids), **gen)[:, ids.shape[1]:]
    times = clock.times
    save_file({"tokens": new.contiguous()}, out)
    print(json.dumps({"peer": name, "prefill_s": times[0] - t0,
                      "decode_ms_per_token": 1e3 * (times[-1] - times[0]) / max(1, len(times) - 1),
                      "tokens": new.tolist()}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("make-batch")
    p.add_argument("kind", choices=("mllama", "openflamingo"))
    p.add_argument("model")
    p.add_argument("batch")
    p = sub.add_parser("run")
    p.add_argument("kind", choices=("mllama", "openflamingo"))
    p.add_argument("model")
    p.add_argument("batch")
    p.add_argument("out")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    if a.cmd == "make-batch":
        make_batch(a.kind, a.model, a.batch)
    else:
        run(a.kind, a.model, a.batch, a.out, a.dtype, a.tokens)


if __name__ == "__main__":
    main()
