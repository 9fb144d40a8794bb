"""Quantized LLM: the official int4 GPTQ layout loads and runs end to end; int8/int4 options."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from serve_app.engines.base import SpeechRequest
from serve_app.engines.minicpmo.engine import EngineOptions, MiniCPMOEngine
from serve_app.engines.minicpmo.model.gptq import (
    GPTQConfig,
    dequantize_gptq_linear,
    gptq_int4_weight,
    unpack_int4,
)
from serve_app.engines.minicpmo.model.layers import (
    SlotKVCache,
    StepInputs,
    causal_attend,
    fuse_projections,
)
from serve_app.engines.minicpmo.model.loader import load_speech_model
from serve_app.engines.minicpmo.model.quantization import (
    BucketedRowsLinear,
    CpuInt4Linear,
    Int4Weight,
    QuantizationUnavailableError,
    int4_group_size,
    quantize_llm,
    require_backend,
)

GROUP_SIZE = 32  # the tiny model's linears have 32 or 64 inputs; the real checkpoint uses 128
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPT = "<|im_start|>user\nPlease read the text below.\nHello there.<|im_end|>\n"


# ---- the test's own GPTQ writer, following AutoGPTQ's QuantLinear.pack -------------------

def rtn_quantize(weight: torch.Tensor, group_size: int, order: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric 4-bit round-to-nearest per group, groups taken along ``order`` of the inputs
    (act-order when it is a permutation). Returns codes [in, out], zeros and fp16 scales
    [groups, out] and g_idx [in]."""
    out_features, in_features = weight.shape
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = torch.arange(in_features, dtype=torch.int32) // group_size
    groups = in_features // group_size
    scales = torch.empty(groups, out_features)
    for group in range(groups):
        columns = weight[:, g_idx == group]
        scales[group] = columns.abs().amax(dim=1) * 2 / 15
    scales = scales.half()
    zeros = torch.full((groups, out_features), 8, dtype=torch.int32)
    per_input = scales.float()[g_idx.long()]  # [in, out]
    codes = torch.clamp(torch.round(weight.t() / per_input) + 8, 0, 15).to(torch.int32)
    return {"codes": codes, "zeros": zeros, "scales": scales, "g_idx": g_idx}


def pack_nibbles(values: np.ndarray, axis: int) -> np.ndarray:
    """8 values 0..15 per uint32 along ``axis``, value ``8 i + j`` in bits ``4 j``."""
    values = np.moveaxis(values.astype(np.uint32), axis, 0)
    packed = np.zeros((values.shape[0] // 8,) + values.shape[1:], dtype=np.uint32)
    for j in range(8):
        packed |= values[j::8] << np.uint32(4 * j)
    return np.ascontiguousarray(np.moveaxis(packed, 0, axis)).view(np.int32)


def gptq_tensors(name: str, quantized: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        f"{name}.qweight": torch.from_numpy(pack_nibbles(quantized["codes"].numpy(), 0)),
        f"{name}.qzeros": torch.from_numpy(pack_nibbles(quantized["zeros"].numpy() - 1, 1)),
        f"{name}.scales": quantized["scales"],
        f"{name}.g_idx": quantized["g_idx"],
    }


def reference_dequantized(quantized: dict[str, torch.Tensor]) -> torch.Tensor:
    g = quantized["g_idx"].long()
    weight = quantized["scales"].float()[g] * (quantized["codes"] - quantized["zeros"][g]).float()
    return weight.t()


def write_int4_checkpoint(source, target) -> dict[str, torch.Tensor]:
    """The tiny checkpoint in the official int4 layout; returns the expected dense weights."""
    shutil.copytree(source, target)
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    expected = {}
    layer = 0
    while f"llm.model.layers.{layer}.self_attn.q_proj.weight" in tensors:
        for linear in LINEARS:
            name = f"llm.model.layers.{layer}.{linear}"
            weight = tensors.pop(f"{name}.weight")
            in_features = weight.shape[1]
            # layer 0 in act-order (a permutation of the inputs), the others in plain order
            order = (torch.randperm(in_features, generator=torch.Generator().manual_seed(7))
                     if layer == 0 else torch.arange(in_features))
            quantized = rtn_quantize(weight, GROUP_SIZE, order)
            tensors.update(gptq_tensors(name, quantized))
            if f"{name}.bias" in tensors:
                tensors[f"{name}.bias"] = tensors[f"{name}.bias"].half()
            expected[name[len("llm."):]] = reference_dequantized(quantized)
        layer += 1
    (target / "model.safetensors").unlink()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "quantize_config.json").write_text(json.dumps({
        "bits": 4, "group_size": GROUP_SIZE, "damp_percent": 0.01, "desc_act": True,
        "static_groups": False, "sym": True, "true_sequential": True,
        "model_name_or_path": None, "model_file_base_name": "model"}))
    return expected


@pytest.fixture(scope="module")
def int4_checkpoint(tiny_checkpoint, tmp_path_factory):
    target = tmp_path_factory.mktemp("int4") / "MiniCPM-o-2_6-int4"
    return target, write_int4_checkpoint(tiny_checkpoint, target)


def speaker_hidden(model) -> torch.Tensor:
    tok = model.tokenizer
    ids = tok(PROMPT + "<|im_end|>\n<|im_start|>assistant\n<|spk_bos|><|spk|>",
              add_special_tokens=False)["input_ids"]
    cache = SlotKVCache(model.config.llm, 1, len(ids), torch.device("cpu"), torch.float32)
    positions = torch.arange(len(ids))[None]
    step = StepInputs(torch.tensor([0]), positions, positions,
                      causal_attend(positions, torch.ones_like(positions, dtype=torch.bool), len(ids) + 1))
    with torch.inference_mode():
        hidden = model.llm.hidden_states(torch.tensor([ids]), cache, step)
    return hidden[0, ids.index(tok.convert_tokens_to_ids("<|spk|>"))]


def read_audio(model) -> np.ndarray:
    options = EngineOptions(device="cpu", dtype="float32", max_slots=2, max_chat_slots=1,
                            admission="slots", tts_max_positions=1024, llm_max_positions=256, tts_sampling="greedy")
    engine = MiniCPMOEngine(model, options)

    async def run() -> np.ndarray:
        request = SpeechRequest(request_id="int4-read", mode="read",
                                text="Hello there, this is a quantized model speaking.")
        (stream,) = engine.submit([request])
        return np.concatenate([chunk.samples async for chunk in stream])

    try:
        return asyncio.run(run())
    finally:
        engine.close()


# ---- the GPTQ format itself ----------------------------------------------------------------

def test_nibbles_unpack_lowest_first_including_the_sign_bit():
    words = torch.from_numpy(np.array([[0x76543210], [0xF0123455]], dtype=np.uint32).view(np.int32))
    np.testing.assert_array_equal(unpack_int4(words, 0)[:8, 0].numpy(), np.arange(8))
    np.testing.assert_array_equal(unpack_int4(words[1:], 1)[0].numpy(), [5, 5, 4, 3, 2, 1, 0, 15])


def test_gptq_config_from_quantize_config_or_config_json(tmp_path):
    assert GPTQConfig.from_checkpoint(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
        "checkpoint_format": "gptq_v2"}}))
    assert GPTQConfig.from_checkpoint(tmp_path) == GPTQConfig(4, 128, False, True, zero_offset=0)
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 128}))
    with pytest.raises(ValueError, match="4-bit"):
        GPTQConfig.from_checkpoint(tmp_path)


def test_gptq_codes_reach_the_int4_kernel_as_stored_unless_act_order():
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    config = GPTQConfig(bits=4, group_size=GROUP_SIZE)
    in_order = gptq_tensors("w", rtn_quantize(weight, GROUP_SIZE, torch.arange(64)))
    parts = {key.rpartition(".")[2]: tensor for key, tensor in in_order.items()}
    int4 = gptq_int4_weight(parts, config)
    assert int4 is not None and int4.codes.dtype == torch.uint8 and int4.shape == (24, 64)
    assert int4.scales.shape == int4.zeros.shape == (24, 64 // GROUP_SIZE)
    # the kernel's (code - zero) * scale is exactly the dense GPTQ weight
    assert torch.equal(int4.dequantize(torch.float32),
                       dequantize_gptq_linear(parts, config, torch.float32))
    act_order = gptq_tensors("w", rtn_quantize(weight, GROUP_SIZE, torch.randperm(64)))
    assert gptq_int4_weight({k.rpartition(".")[2]: t for k, t in act_order.items()}, config) is None


def test_int4_quantization_rounds_to_the_nearest_of_sixteen_levels_per_group():
    weight = torch.randn(8, 256, generator=torch.Generator().manual_seed(5)) * 0.02
    int4 = Int4Weight.quantize(weight, group_size=128)
    assert int4.codes.max() <= 15 and int4.codes.min() == 0
    error = (int4.dequantize(torch.float32) - weight).abs()
    step = int4.scales.repeat_interleave(128, dim=1)
    assert (error <= step / 2 + 1e-7).all()
    grouped = weight.reshape(8, 2, 128)
    lows = int4.dequantize(torch.float32).reshape(8, 2, 128).amin(-1)
    torch.testing.assert_close(lows, grouped.amin(-1))  # a group's extremes are levels
    fused = Int4Weight.concatenate([int4, Int4Weight.quantize(weight[:3], 128)])
    assert fused.shape == (11, 256)
    assert torch.equal(fused.dequantize(torch.float32)[8:], int4.dequantize(torch.float32)[:3])


def test_torchao_quantization_of_a_fused_model_quantizes_what_it_runs(tiny_checkpoint):
    """Quantizing after q/k/v and gate/up were fused (as a benchmark quantizes a model an engine
    already ran) must run the quantized weights, not the fused float copy."""
    pytest.importorskip("torchao")
    before = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32,
                               quantization="int8")
    after = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    fuse_projections(after.llm)
    assert after.llm.model.layers[0].self_attn.fused_qkv is not None
    quantize_llm(after.llm, "int8")
    torch.testing.assert_close(speaker_hidden(after), speaker_hidden(before), rtol=0, atol=0)


def test_bucketed_rows_run_the_kernel_only_at_bucket_counts_and_cut_the_padding():
    """GemLite's wrapper (BucketedRowsLinear) pads every call to a row count the warm-up ran;
    here over the CPU int4 kernel with buckets of 8: the kernel sees only multiples of 8, and
    every row's output is what the kernel gives that row unpadded."""
    weight = torch.randn(48, 128) * 0.02
    kernel = CpuInt4Linear(Int4Weight.quantize(weight, 32), torch.randn(48), torch.float32)
    seen = []
    kernel.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    linear = BucketedRowsLinear(kernel, 128, 48, lambda rows: -(-rows // 8) * 8)
    for rows in (1, 7, 8, 13, 24):
        x = torch.randn(rows, 128)
        got = linear(x)
        assert got.shape == (rows, 48)
        torch.testing.assert_close(got, kernel(x), rtol=0, atol=0)
        assert seen[-2] == -(-rows // 8) * 8  # the wrapper's call, then the reference's
    batched = torch.randn(3, 5, 128)  # leading dimensions are flattened and restored
    torch.testing.assert_close(linear(batched), kernel(batched), rtol=0, atol=0)
    assert seen[-2] == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GemLite's int4 kernels run on CUDA")
def test_int4_kernel_matches_its_dequantized_weight_on_cuda():
    pytest.importorskip("gemlite")
    from serve_app.engines.minicpmo.model.quantization import gemlite_linear

    weight = torch.randn(512, 1024, device="cuda") * 0.02
    int4 = Int4Weight.quantize(weight)
    bias = torch.randn(512, device="cuda")
    linear = gemlite_linear(int4, bias, torch.bfloat16)
    dense = int4.dequantize(torch.bfloat16)
    for rows in (1, 8, 64, 300):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        reference = (x.float() @ dense.float().t() + bias).float()
        assert ((linear(x).float() - reference).norm() / reference.norm()) < 1e-2, rows


# ---- the official int4 layout end to end ---------------------------------------------------

def test_int4_checkpoint_dequantizes_exactly_and_speaks(tiny_checkpoint, int4_checkpoint):
    path, expected = int4_checkpoint
    dense = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    model = load_speech_model(str(path), device="cpu", dtype=torch.float32, quantization="none")
    state = model.llm.state_dict()
    for name, weight in expected.items():
        assert torch.equal(state[f"{name}.weight"], weight), name
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert torch.equal(state[bias], dense.llm.state_dict()[bias].half().float())
    # everything outside the decoder linears is the dense checkpoint's
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(state[name], dense.llm.state_dict()[name])
    for (name, a), (_, b) in zip(dense.tts.state_dict().items(), model.tts.state_dict().items()):
        assert torch.equal(a, b), name

    reference, quantized = speaker_hidden(dense), speaker_hidden(model)
    relative = ((quantized - reference).norm() / reference.norm()).item()
    assert relative < 0.15, relative
    assert torch.nn.functional.cosine_similarity(quantized, reference, dim=0) > 0.99

    audio = read_audio(model)
    assert audio.dtype == np.float32 and len(audio) > 0
    assert np.isfinite(audio).all() and np.abs(audio).max() > 0


def checkpoint_in_group_order(path) -> dict[str, bool]:
    """Whether each GPTQ linear of the checkpoint at ``path`` has its groups in input order
    (``g_idx[k] == k // GROUP_SIZE``), by decoder linear name (``model.layers.0.mlp.down_proj``)."""
    in_order = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        for key in handle.keys():
            if key.endswith(".g_idx"):
                g_idx = handle.get_tensor(key).long()
                consecutive = torch.arange(len(g_idx)) // GROUP_SIZE
                in_order[key[len("llm."):-len(".g_idx")]] = torch.equal(g_idx, consecutive)
    return in_order


def kernel_weight(kernel: CpuInt4Linear) -> torch.Tensor:
    """The dense weight [out, in] an int4 linear multiplies by: its output for each one-hot
    input (one product per output and exact sums of zeros), less its bias."""
    out = kernel(torch.eye(kernel.in_features))
    return (out - (kernel.bias if kernel.bias is not None else 0)).t()


def test_int4_on_cpu_runs_the_checkpoints_codes_through_an_int4_kernel(tiny_checkpoint,
                                                                       int4_checkpoint):
    """``int4`` on CPU: torch's own int4 kernel over fused q/k/v and gate/up. Linears whose
    groups are runs of consecutive inputs reach it as stored (it computes with exactly the
    checkpoint's weight); a linear whose act-order permutation moves inputs between groups is
    dequantized and quantized again in group order; the model speaks.

    Act-order only matters across groups: layer 0 is written in act-order, but of its linears
    only down_proj (64 inputs) has more than one group of 32; the others' ``g_idx`` are all 0,
    which is group order, so they too reach the kernel as stored. What the kernel's sums give
    beyond the weight is float rounding, which differs between CPUs (on some, the int4 kernel and
    ``x @ w.t()`` add in the same order and agree to the bit): nothing here asks for it to be
    zero or not zero."""
    path, expected = int4_checkpoint
    in_order = checkpoint_in_group_order(path)
    requantized = sorted(name for name, ordered in in_order.items() if not ordered)
    assert requantized == ["model.layers.0.mlp.down_proj"], requantized
    dense = load_speech_model(str(path), device="cpu", dtype=torch.float32, quantization="none")
    model = load_speech_model(str(path), device="cpu", dtype=torch.float32, quantization="int4")
    layers = model.llm.model.layers
    assert all(type(m) is not torch.nn.Linear for m in layers.modules())
    for index, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj is None and mlp.gate_proj is None
        for kernel, names in ((attn.fused_qkv, ("self_attn.q_proj", "self_attn.k_proj",
                                                "self_attn.v_proj")),
                              (attn.o_proj, ("self_attn.o_proj",)),
                              (mlp.fused_gate_up, ("mlp.gate_proj", "mlp.up_proj")),
                              (mlp.down_proj, ("mlp.down_proj",))):
            assert isinstance(kernel, CpuInt4Linear)
            stored, runs = [], []
            for name in names:
                weight = expected[f"model.layers.{index}.{name}"]
                stored.append(weight)
                if in_order[f"model.layers.{index}.{name}"]:
                    runs.append(weight)  # the checkpoint's codes as they are
                else:  # its dense weight quantized again, in groups of consecutive inputs
                    group_size = int4_group_size(weight.shape[1])
                    runs.append(Int4Weight.quantize(weight, group_size).dequantize(torch.float32))
            stored, runs = torch.cat(stored), torch.cat(runs)
            # the weight it multiplies by, up to float rounding
            torch.testing.assert_close(kernel_weight(kernel), runs, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{index} {names}: {m}")
            if not all(in_order[f"model.layers.{index}.{name}"] for name in names):
                # requantized: close to the checkpoint's weight, but not it
                changed = ((runs - stored).norm() / stored.norm()).item()
                assert 1e-3 < changed < 0.2, (index, names, changed)
            # and a product with it, up to float rounding (zero on some CPUs, not on others)
            x = torch.randn(5, runs.shape[1], generator=torch.Generator().manual_seed(index))
            got = kernel(x) - (kernel.bias if kernel.bias is not None else 0)
            error = ((got - x @ runs.t()).norm() / (x @ runs.t()).norm()).item()
            assert error < 1e-5, (index, names, error)
    bias = torch.cat([dense.llm.model.layers[1].self_attn.get_submodule(n).bias
                      for n in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(layers[1].self_attn.fused_qkv.bias, bias)
    reference, quantized = speaker_hidden(dense), speaker_hidden(model)
    assert ((quantized - reference).norm() / reference.norm()).item() < 0.15
    audio = read_audio(model)
    assert len(audio) > 0 and np.isfinite(audio).all() and np.abs(audio).max() > 0


def test_int8_on_load_quantizes_decoder_linears_only(tiny_checkpoint):
    pytest.importorskip("torchao")
    dense = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32,
                              quantization="int8")
    layer = model.llm.model.layers[0]
    for linear in (layer.self_attn.q_proj, layer.mlp.down_proj):
        assert type(linear.weight).__name__ == "Int8Tensor"
    assert type(model.llm.lm_head.weight) is torch.nn.Parameter  # lm_head stays dense
    assert type(model.llm.model.embed_tokens.weight) is torch.nn.Parameter
    assert all(type(p) is torch.nn.Parameter for p in model.tts.parameters())
    reference, quantized = speaker_hidden(dense), speaker_hidden(model)
    assert ((quantized - reference).norm() / reference.norm()).item() < 0.02
    audio = read_audio(model)
    assert len(audio) > 0 and np.isfinite(audio).all()


def test_missing_torchao_is_a_clear_error_and_cpu_int4_needs_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(QuantizationUnavailableError, match=r"\[quant\]"):
        require_backend("int8", torch.device("cpu"))
    with pytest.raises(QuantizationUnavailableError, match="torchao"):
        require_backend("int4-tinygemm", torch.device("cuda"))
    monkeypatch.setitem(sys.modules, "gemlite", None)
    monkeypatch.setitem(sys.modules, "gemlite.core", None)
    with pytest.raises(QuantizationUnavailableError, match=r"gemlite.*\[gpu\]"):
        require_backend("int4", torch.device("cuda"))
    require_backend("int4", torch.device("cpu"))  # torch's own CPU kernel; no library needed
    require_backend("none", torch.device("cuda"))


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="int4"):
        EngineOptions(quantization="int3")
    with pytest.raises(ValueError, match="quantization"):
        MiniCPMOEngine.from_options(model="unused", quantization="fp8")
