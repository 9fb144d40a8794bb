#!/usr/bin/env python3
"""Where the error of the quantized LLM comes from, on full-size random weights (GPU).

For one prompt it compares bf16 and the quantized LLM (same weights) layer by layer, so the
per-layer error and its growth with depth are visible, and checks single linears: the kernel's
output against the bf16 matmul and against a matmul with the weight its format represents
(``int4``: GemLite over :class:`Int4Weight`; ``int4-tinygemm``: torchao's own primitives; that
difference is the kernel's, not the format's).
It does so for the default random init (std 0.02 everywhere) and for a depth-scaled init
(``o_proj``/``down_proj`` scaled by 1/sqrt(2 x layers), as GPT-2 initialises them), and can add
Poisson-arrival engine runs at ``--poisson-concurrency`` for bf16 and the quantized LLM.
Writes JSON to ``--out``.

Example: python -m bench.accuracy.quantization --quantization int4 --poisson-concurrency 32 \\
    --out docs/benchmarks/int4-accuracy-h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.engine.compare_quantization import free_gpu, prompt_logits
from bench.engine.measure import build_engine, run_level
from harness.service import git_commit
from serve_app.engines.minicpmo.model.quantization import (
    INT4_GROUP_SIZE,
    Int4Weight,
    int4_linear,
    quantize_linears,
    quantize_llm,
)
from serve_app.engines.minicpmo.model.synthetic import random_speech_model

ROOT = Path(__file__).resolve().parents[2]


def relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference.float()).norm() / reference.float().norm())


def tinygemm_dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The weight int4 (tinygemm, group 128, asymmetric) represents, by torchao's primitives."""
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_qparams_affine_tinygemm,
        _dequantize_affine_tinygemm,
        _quantize_affine_tinygemm,
    )

    block = (1, INT4_GROUP_SIZE)
    scale, zero = _choose_qparams_affine_tinygemm(
        weight, MappingType.ASYMMETRIC, block, torch.int32, 0, 15,
        scale_dtype=weight.dtype, zero_point_dtype=weight.dtype)
    codes = _quantize_affine_tinygemm(weight, block, scale, zero, torch.int32, 0, 15)
    return _dequantize_affine_tinygemm(codes, block, scale, zero, torch.int32, 0, 15,
                                       output_dtype=weight.dtype)


def linear_checks(model, mode: str, device: str) -> dict:
    """Single linears of the first and last layer: kernel vs bf16 vs dequantized reference."""
    generator = torch.Generator(device="cpu").manual_seed(1)
    layers = model.llm.model.layers
    out = {}
    for index in (0, len(layers) - 1):
        for name in ("self_attn.q_proj", "mlp.down_proj"):
            source = layers[index].get_submodule(name)
            weight = source.weight.detach()
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=device,
                               dtype=weight.dtype)
            linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
            x = torch.randn(64, weight.shape[1], generator=generator).to(device, weight.dtype)
            with torch.inference_mode():
                reference = F.linear(x, weight)
                if mode == "int4":
                    int4 = Int4Weight.quantize(weight, INT4_GROUP_SIZE)
                    quantized = int4_linear(int4, None, weight.dtype)(x)
                else:
                    quantize_linears(linear, mode)
                    quantized = linear(x)
            row = {"kernel_vs_bf16": relative(quantized, reference)}
            if mode.startswith("int4"):
                dequantized = (int4.dequantize(weight.dtype) if mode == "int4"
                               else tinygemm_dequantized(weight))
                row["weight_error"] = relative(dequantized, weight)
                row["kernel_vs_dequantized_matmul"] = relative(quantized, F.linear(x, dequantized))
            out[f"layers.{index}.{name}"] = row
    return out


def layer_outputs(model, prompt: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    captured: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, output: captured.append(output.float()))
             for layer in model.llm.model.layers]
    try:
        hidden, logits = prompt_logits(model, prompt)
    finally:
        for hook in hooks:
            hook.remove()
    return captured, hidden, logits


def depth_scale(model) -> None:
    factor = (2 * len(model.llm.model.layers)) ** -0.5
    with torch.no_grad():
        for layer in model.llm.model.layers:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)


def poisson_rows(model, args, label: str) -> list[dict]:
    rows = []
    engine_args = argparse.Namespace(**{**vars(args), "no_graphs": False, "dtype": "bfloat16",
                                        "arrivals": ["poisson"], "max_chat_slots": 256,
                                        "tts_positions": 1024, "llm_positions": 512})
    engine = build_engine(model, engine_args, max(args.poisson_concurrency))
    for mode in ("read", "chat"):
        asyncio.run(run_level(engine, mode, 1, "burst", engine_args))  # warm-up
        for concurrency in args.poisson_concurrency:
            row = asyncio.run(run_level(engine, mode, concurrency, "poisson", engine_args))
            row["variant"] = label
            rows.append(row)
    engine.close()
    del engine
    free_gpu()
    return rows


def analyse(args, init: str, with_poisson: bool) -> dict:
    model = random_speech_model(args.tts_tokenizer, args.device, torch.bfloat16)
    if init == "depth_scaled":
        depth_scale(model)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(16, model.config.vocab_size, (1, args.prompt_tokens),
                           generator=generator).to(args.device)
    result: dict = {"init": init}
    if with_poisson and args.poisson_concurrency:
        result["poisson"] = poisson_rows(model, args, "bf16")
    result["linears"] = linear_checks(model, args.quantization, args.device)
    reference_layers, reference_hidden, reference_logits = layer_outputs(model, prompt)
    quantize_llm(model.llm, args.quantization)
    free_gpu()
    layers, hidden, logits = layer_outputs(model, prompt)
    result["layer_output_relative_l2"] = [relative(a, b) for a, b in zip(layers, reference_layers)]
    result["final_hidden_relative_l2"] = relative(hidden, reference_hidden)
    result["logits_relative_l2"] = relative(logits, reference_logits)
    result["top1_agreement"] = float((logits.argmax(-1) == reference_logits.argmax(-1)).float().mean())
    result["reference_logits_std"] = float(reference_logits.float().std())
    print(json.dumps({k: v for k, v in result.items() if k != "poisson"}), flush=True)
    if with_poisson and args.poisson_concurrency:
        result["poisson"] += poisson_rows(model, args, args.quantization)
    del model
    free_gpu()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quantization", choices=["int8", "int4", "int4-tinygemm"], default="int4")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--poisson-concurrency", nargs="*", type=int, default=[])
    parser.add_argument("--audio-seconds", type=float, default=10.0)
    parser.add_argument("--chat-tokens", type=int, default=40)
    parser.add_argument("--tts-tokenizer", default=str(ROOT / "tests" / "golden" / "chattts_tokenizer"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from importlib.metadata import version

    started = time.perf_counter()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"gpu": gpu, "command": " ".join(["python -m bench.accuracy.quantization"] + sys.argv[1:]),
              "git_commit": git_commit(), "torch": torch.__version__,
              "torchao": version("torchao"), "gemlite": version("gemlite"),
              "quantization": args.quantization,
              "prompt_tokens": args.prompt_tokens}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for init in ("default", "depth_scaled"):
        result[init] = analyse(args, init, with_poisson=init == "default")
        out.write_text(json.dumps(result, indent=2))
    result["total_s"] = time.perf_counter() - started
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
