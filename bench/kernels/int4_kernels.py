"""int4 weight-only matmul kernels against bf16 cuBLAS at the LLM's own shapes.

One decoder layer of MiniCPM-o's LLM (Qwen2-7B) runs four matmuls: fused q/k/v
(3584 -> 4608), o (3584 -> 3584), fused gate/up (3584 -> 37888) and down (18944 -> 3584).
For each ``--rows`` M (tokens in the batch: 1 for one decode row, 8-64 for batched decode,
256-1024 for admission prefills) this times every candidate on all four shapes:

- ``bf16``: ``F.linear`` on bf16 weights (cuBLAS);
- ``int4-gemlite``: GemLite's Triton kernels, the engine's ``int4`` (groups of 128, zeros);
- ``int4-tinygemm``: torchao's ``tile_packed_to_4d`` int4, PyTorch's tinygemm kernel
  (``int4-tinygemm``; what ``int4`` was before);
- ``fp8-rowwise`` (Hopper only, a second path): torchao's dynamic fp8 activations x fp8 weights
  with one scale per row (``torch._scaled_mm``).

Each timing is a CUDA graph of ``--calls`` back-to-back calls (the engine replays its decode
steps as graphs) going round copies of the weight that add up to more than the L2 cache,
the median of ``--trials`` replays, divided by the calls. ``layer_us`` sums the four shapes;
``llm_ms`` is 28 layers of that (the decoder linears of one LLM step).
``rel_error`` is ||y - y_bf16|| / ||y_bf16|| at 8 rows, against the unquantized weight.

``load`` times turning one decoder layer's GPTQ tensors (the official int4 checkpoint's layout,
random codes) into the int4 kernel's weights: straight from the codes, scales and zeros
(``gptq_int4_weight``) or through a dense bf16 weight quantized again, and how far each lands
from the checkpoint's own weight. Reading the files is not included.

Example (GPU): python -m bench.kernels.int4_kernels --out docs/benchmarks/int4-kernels-h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from harness.service import git_commit
from serve_app.engines.minicpmo.model.gptq import (
    GPTQConfig,
    dequantize_gptq_linear,
    gptq_int4_weight,
)
from serve_app.engines.minicpmo.model.quantization import (
    INT4_GROUP_SIZE,
    Int4Weight,
    gemlite_linear,
)
from serve_app.engines.minicpmo.model.synthetic import REAL_LLM_CONFIG

ROOT = Path(__file__).resolve().parents[2]

HIDDEN = REAL_LLM_CONFIG["hidden_size"]
INTERMEDIATE = REAL_LLM_CONFIG["intermediate_size"]
LAYERS = REAL_LLM_CONFIG["num_hidden_layers"]
HEAD_DIM = HIDDEN // REAL_LLM_CONFIG["num_attention_heads"]
KV = REAL_LLM_CONFIG["num_key_value_heads"] * HEAD_DIM
L2_BYTES = 50 * 2 ** 20  # H100's L2 (A100 40 MB, A10G 6 MB): the copies' weights exceed it
# (name, in_features, [out_features of each linear fused into it])
SHAPES = [("qkv", HIDDEN, [HIDDEN, KV, KV]), ("o", HIDDEN, [HIDDEN]),
          ("gate_up", HIDDEN, [INTERMEDIATE, INTERMEDIATE]), ("down", INTERMEDIATE, [HIDDEN])]


def build(candidate: str, weight: torch.Tensor) -> tuple[object, int]:
    """A callable computing x @ weight.T with ``candidate``'s kernel, and its weight bytes."""
    if candidate == "bf16":
        return (lambda x: F.linear(x, weight)), weight.numel() * weight.element_size()
    if candidate == "int4-gemlite":
        linear = gemlite_linear(Int4Weight.quantize(weight, INT4_GROUP_SIZE), None, weight.dtype)
        kernel = linear.kernel
        return linear, sum(t.numel() * t.element_size() for t in (kernel.W_q, kernel.scales, kernel.zeros))
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        PerRow,
        quantize_,
    )

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                       dtype=weight.dtype)
    linear.weight.data.copy_(weight)
    if candidate == "int4-tinygemm":
        config = Int4WeightOnlyConfig(group_size=INT4_GROUP_SIZE,
                                      int4_packing_format="tile_packed_to_4d",
                                      set_inductor_config=False)
    else:
        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(),
                                                           set_inductor_config=False)
    quantize_(linear, config)
    stored = linear.weight
    names = getattr(stored, "tensor_data_names", None) or []
    parts = [getattr(stored, name) for name in names if getattr(stored, name, None) is not None]
    return linear, sum(p.numel() * p.element_size() for p in parts)


def time_call(fns: list, x: torch.Tensor, calls: int, trials: int) -> float:
    """Microseconds per call: a CUDA graph of ``calls`` calls, going round ``fns`` (copies of
    one weight, so that the weights read add up to more than the L2 cache, as 28 layers do),
    median over ``trials`` replays."""
    for fn in fns:  # compile and autotune outside the graph
        for _ in range(2):
            fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(calls):
            fns[call % len(fns)](x)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def measure_candidate(candidate: str, name: str, weight: torch.Tensor, outs: list[int],
                      probe: torch.Tensor, reference: torch.Tensor, args, rows: list[dict],
                      generator: torch.Generator) -> None:
    fn, weight_bytes = build(candidate, weight)
    # enough copies that one graph's weights exceed the L2 cache three times over
    copies = max(1, min(16, -(-3 * L2_BYTES // weight_bytes)))
    fns = [fn] + [build(candidate, weight.clone())[0] for _ in range(copies - 1)]
    in_features = weight.shape[1]
    with torch.inference_mode():
        error = float((fn(probe).float() - reference).norm() / reference.norm())
        for m in args.rows:
            x = torch.randn(m, in_features, device=weight.device, generator=generator).to(torch.bfloat16)
            us = time_call(fns, x, args.calls, args.trials)
            moved = weight_bytes + 2 * m * (in_features + sum(outs))
            row = {"shape": name, "n": sum(outs), "k": in_features, "m": m,
                   "candidate": candidate, "weight_copies": copies, "us": round(us, 2),
                   "weight_bytes": weight_bytes,
                   "tb_per_s": round(moved / us / 1e6, 3),
                   "tflop_per_s": round(2 * m * in_features * sum(outs) / us / 1e6, 2),
                   "rel_error": error}
            rows.append(row)
            print(json.dumps(row), flush=True)


def kernel_table(args, device: torch.device) -> list[dict]:
    hopper = torch.cuda.get_device_capability(device) >= (9, 0)
    candidates = [c for c in args.candidates if c != "fp8-rowwise" or hopper]
    generator = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, in_features, outs in SHAPES:
        weight = (torch.randn(sum(outs), in_features, device=device, generator=generator)
                  * 0.02).to(torch.bfloat16)
        probe = torch.randn(8, in_features, device=device, generator=generator).to(torch.bfloat16)
        reference = F.linear(probe, weight).float()
        for candidate in candidates:
            try:  # a kernel missing or failing on this GPU is a row, not a crash
                measure_candidate(candidate, name, weight, outs, probe, reference, args, rows,
                                  generator)
            except Exception as error:
                rows.append({"shape": name, "candidate": candidate, "error": repr(error)})
                print(f"{name} {candidate}: {error!r}", flush=True)
            torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict], candidates: list[str], ms: list[int]) -> dict:
    """Per candidate and M: one decoder layer's four matmuls (us), the LLM's 28 (ms), and the
    speed against bf16."""
    out = {}
    for candidate in candidates:
        per_m = {}
        for m in ms:
            timed = [r for r in rows if r["candidate"] == candidate and r.get("m") == m]
            if len(timed) != len(SHAPES):
                continue
            layer_us = sum(r["us"] for r in timed)
            bf16 = [r for r in rows if r["candidate"] == "bf16" and r.get("m") == m]
            per_m[m] = {"layer_us": round(layer_us, 1), "llm_ms": round(layer_us * LAYERS / 1000, 3),
                        "speed_vs_bf16": round(sum(r["us"] for r in bf16) / layer_us, 2)
                        if len(bf16) == len(SHAPES) else None}
        if per_m:
            out[candidate] = per_m
    return out


def random_gptq_linear(out_features: int, in_features: int, device, generator) -> dict:
    """One linear in the GPTQ layout (codes in plain group order, v1 zeros stored minus one)."""
    groups = in_features // INT4_GROUP_SIZE
    words = lambda *shape: torch.randint(-2 ** 31, 2 ** 31 - 1, shape, device=device,  # noqa: E731
                                         generator=generator, dtype=torch.int64).to(torch.int32)
    return {"qweight": words(in_features // 8, out_features),
            "qzeros": words(groups, out_features // 8),
            "scales": (torch.rand(groups, out_features, device=device, generator=generator)
                       * 0.004 + 0.001).half(),
            "g_idx": (torch.arange(in_features, device=device) // INT4_GROUP_SIZE).int()}


def load_paths(device: torch.device) -> dict:
    """One decoder layer's GPTQ linears into the int4 kernel, two ways, timed and compared."""
    config = GPTQConfig(bits=4, group_size=INT4_GROUP_SIZE)
    generator = torch.Generator(device=device).manual_seed(1)
    fused = [[random_gptq_linear(out, in_features, device, generator) for out in outs]
             for _, in_features, outs in SHAPES]
    checkpoint = [[dequantize_gptq_linear(p, config, torch.float32) for p in group] for group in fused]

    def direct(group):
        return Int4Weight.concatenate([gptq_int4_weight(p, config) for p in group])

    def through_dense(group):
        return Int4Weight.concatenate([Int4Weight.quantize(dequantize_gptq_linear(p, config, torch.bfloat16))
                                       for p in group])

    result = {}
    for label, convert in (("direct", direct), ("dequantize_requantize", through_dense)):
        for _ in range(2):  # the second pass is timed (kernels compiled, allocator warm)
            torch.cuda.synchronize()
            started = time.perf_counter()
            weights = [convert(group) for group in fused]
            modules = [gemlite_linear(w, None, torch.bfloat16) for w in weights]
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
        errors = [float((w.dequantize(torch.float32) - torch.cat(dense)).norm() / torch.cat(dense).norm())
                  for w, dense in zip(weights, checkpoint)]
        result[label] = {"layer_s": round(seconds, 4), "llm_s": round(seconds * LAYERS, 2),
                         "weight_rel_error_vs_checkpoint": max(errors)}
        del modules, weights
        print(label, json.dumps(result[label]), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256, 1024])
    parser.add_argument("--candidates", nargs="+",
                        default=["bf16", "int4-gemlite", "int4-tinygemm", "fp8-rowwise"])
    parser.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.kernels.int4_kernels needs a CUDA GPU")
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name()
    from importlib.metadata import version

    started = time.perf_counter()
    result = {"gpu": gpu, "command": " ".join(["python -m bench.kernels.int4_kernels"] + sys.argv[1:]),
              "git_commit": git_commit(), "torch": torch.__version__,
              "libraries": {name: version(name) for name in ("gemlite", "torchao", "triton")},
              "method": "us: one call, from a CUDA graph of --calls calls, median of --trials "
              "replays; layer_us: the four matmuls of one decoder layer (fused qkv, o, fused "
              "gate_up, down); llm_ms: 28 layers; tb_per_s: weight + activation bytes / time; "
              "rel_error: against the unquantized bf16 weight at 8 rows"}
    rows = kernel_table(args, device)
    result["rows"] = rows
    result["per_layer"] = summary(rows, args.candidates, args.rows)
    if not args.skip_load:
        result["load"] = load_paths(device)
    result["total_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out) if args.out else ROOT / "docs" / "benchmarks" / f"int4-kernels-{gpu.split()[1].lower()}.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["per_layer"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
