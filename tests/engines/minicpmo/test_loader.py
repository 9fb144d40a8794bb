"""The production loader on the official layout: shards + index, bf16 storage, decoys skipped."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from serve_app.engines.minicpmo.model.loader import (
    AUDIO_IN_PREFIXES,
    SKIPPED_PREFIXES,
    iter_tensors,
    load_speech_model,
)
from tests.golden_voice.checkpoint import load_manifest as load_voice_manifest


def write_sharded_bf16(source, target) -> None:
    """Rewrite the tiny checkpoint as two bf16 shards with an index, like the Hub layout."""
    shutil.copytree(source, target)
    (target / "model.safetensors").unlink()
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key).to(torch.bfloat16) for key in handle.keys()}
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for name, shard_keys in shards.items():
        save_file({k: tensors[k] for k in shard_keys}, str(target / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard_keys})
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_bf16_checkpoint_loads_like_the_single_file(tiny_checkpoint, tmp_path):
    sharded = tmp_path / "sharded"
    write_sharded_bf16(tiny_checkpoint, sharded)
    single = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    split = load_speech_model(str(sharded), device="cpu", dtype=torch.float32)
    for (name, a), (_, b) in zip(single.llm.state_dict().items(), split.llm.state_dict().items()):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(b, a.to(torch.bfloat16).float(), msg=name)
    head_a, head_b = single.tts.head_code.weight, split.tts.head_code.weight
    torch.testing.assert_close(head_b, head_a, rtol=2e-2, atol=2e-2)


def test_vision_and_audio_input_weights_are_never_read(tiny_checkpoint):
    read = [key for key, _ in iter_tensors(tiny_checkpoint, lambda key: True, torch.device("cpu"),
                                           torch.float32)]
    assert read and not any(key.startswith(SKIPPED_PREFIXES) for key in read)
    model = load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32)
    tts_names = [n for n, _ in model.tts.named_parameters()]
    assert "model.embed_tokens.weight" not in tts_names  # the TTS's unused token table
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.llm.parameters())


def test_the_audio_encoder_is_read_only_for_voice_cloning_and_vision_never(voice_checkpoint):
    names = {spec["name"] for spec in load_voice_manifest()["model_tensors"]}
    assert any(n.startswith(SKIPPED_PREFIXES) for n in names)  # the decoys are in the file
    read = [key for key, _ in iter_tensors(voice_checkpoint, lambda key: True, torch.device("cpu"),
                                           torch.float32)]
    assert read and not any(key.startswith(SKIPPED_PREFIXES) for key in read)
    without = load_speech_model(str(voice_checkpoint), device="cpu", dtype=torch.float32)
    assert without.clip_encoder is None
    model = load_speech_model(str(voice_checkpoint), device="cpu", dtype=torch.bfloat16,
                              audio_encoder=True)
    assert set(model.clip_encoder.state_dict()) == {n for n in names if n.startswith(AUDIO_IN_PREFIXES)}
    assert all(p.dtype == torch.bfloat16 for p in model.clip_encoder.parameters())
    config = model.config.audio
    assert (config.pool_step, config.chunk_length_s, config.tokens_per_chunk,
            config.max_audio_tokens) == (2, 1.0, 25, 750)


def test_a_checkpoint_without_an_audio_encoder_refuses_voice_cloning(tiny_checkpoint):
    with pytest.raises(ValueError, match="audio_config"):
        load_speech_model(str(tiny_checkpoint), device="cpu", dtype=torch.float32,
                          audio_encoder=True)
