"""Time the fused decode attention kernel (model/range_attention.py) alone on a GPU: the cache
in bf16 and in fp8 (e4m3 + scales), at a read-like spread of visible keys, for a few tile
sizes and warp counts.

    python -m bench.kernels.range_kernel --rows 768 1024
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.kernels.audio_step import elapsed_ms
from serve_app.engines.minicpmo.model import range_attention
from serve_app.engines.minicpmo.model.kv_cache import SlotKVCache
from serve_app.engines.minicpmo.model.layers import DecoderShape

SHAPE = DecoderShape(hidden_size=768, intermediate_size=3072, num_layers=1, num_heads=12,
                     num_kv_heads=12, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[768, 1024])
    parser.add_argument("--tiles", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    for rows in args.rows:
        g = torch.Generator(device="cpu").manual_seed(0)
        text = torch.randint(30, 200, (rows,), generator=g)
        audio = torch.randint(1, 700, (rows,), generator=g)
        ranges = torch.stack([text, torch.full_like(text, 303), 303 + audio], dim=1).to(device)
        written = (302 + audio).to(device)
        slots = torch.randperm(rows, generator=g).to(device)
        heads, dim = SHAPE.num_heads, SHAPE.head_dim
        q = torch.randn(rows, heads, dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(rows, heads, dim, device=device, dtype=torch.bfloat16)
        v = torch.randn(rows, heads, dim, device=device, dtype=torch.bfloat16)
        cos = torch.randn(rows, dim, device=device, dtype=torch.bfloat16)
        sin = torch.randn(rows, dim, device=device, dtype=torch.bfloat16)
        keys_seen = int((text + audio).sum())
        for kv_dtype in ("auto", "fp8_e4m3"):
            cache = SlotKVCache(SHAPE, rows, 1024, device, torch.bfloat16, kv_dtype)
            if cache.quantized:
                cache.all_keys.view(torch.uint8).random_(0, 120)
                cache.all_values.view(torch.uint8).random_(0, 120)
                cache.all_key_scales.fill_(0.01)
                cache.all_value_scales.fill_(0.01)
            else:
                cache.all_keys.normal_()
                cache.all_values.normal_()
            kv = cache.layers[0]
            for tile in args.tiles:
                for warps in args.warps:
                    if cache.quantized:
                        range_attention.FP8_KEY_TILE, range_attention.FP8_KERNEL_WARPS = tile, warps
                    else:
                        range_attention.KEY_TILE, range_attention.KERNEL_WARPS = tile, warps
                    ms = elapsed_ms(lambda: range_attention.rope_write_two_range_attention(
                        q, k, v, cos, sin, kv.keys, kv.values, slots, written, ranges,
                        kv.key_scales, kv.value_scales), repeats=50)
                    per_key = cache.bytes_per_slot / (cache.max_positions + 1)  # all layers: 1 here
                    row = {"rows": rows, "kv_dtype": kv_dtype, "tile": tile, "warps": warps,
                           "ms": round(ms, 4), "keys_seen": keys_seen,
                           "gb_per_s": round(keys_seen * per_key / ms / 1e6, 1)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
            del cache
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
