"""The project's checkpoint generator reproduces the golden recipe's tensors."""

import zlib

import torch
from safetensors import safe_open

from serve_app.engines.minicpmo.model.synthetic import synthetic_tensor
from tests.golden.checkpoint import load_manifest


def test_tiny_checkpoint_holds_every_manifest_tensor_with_recipe_values(tiny_checkpoint):
    manifest = load_manifest()
    with safe_open(str(tiny_checkpoint / "model.safetensors"), framework="pt") as handle:
        keys = set(handle.keys())
        assert keys == {spec["name"] for spec in manifest["model_tensors"]}
        spec = next(s for s in manifest["model_tensors"] if s["init"] == "linear")
        tensor = handle.get_tensor(spec["name"])
    generator = torch.Generator().manual_seed(zlib.crc32(spec["name"].encode()))
    uniform = torch.rand(spec["shape"], generator=generator) * 2 - 1
    fan_in = 1
    for dim in spec["shape"][1:]:
        fan_in *= dim
    assert torch.equal(tensor, uniform * fan_in ** -0.5)
    vocos = torch.load(tiny_checkpoint / "assets" / "Vocos.pt", weights_only=True)
    assert set(vocos) == {spec["name"] for spec in manifest["vocos_tensors"]}
    assert torch.equal(vocos["head.istft.window"], torch.hann_window(1024))


def test_unknown_init_rule_is_refused():
    try:
        synthetic_tensor("x", [2], "gaussian")
    except ValueError as error:
        assert "gaussian" in str(error)
    else:
        raise AssertionError("unknown init rule accepted")


def test_voice_checkpoint_holds_the_audio_encoder_and_the_decoys(voice_checkpoint):
    from tests.golden_voice.checkpoint import load_manifest as load_voice_manifest

    specs = {spec["name"]: spec for spec in load_voice_manifest()["model_tensors"]}
    with safe_open(str(voice_checkpoint / "model.safetensors"), framework="pt") as handle:
        assert set(handle.keys()) == set(specs)
        for name in ("apm.embed_positions.weight", "audio_projection_layer.linear1.weight"):
            spec = specs[name]
            assert torch.equal(handle.get_tensor(name),
                               synthetic_tensor(name, spec["shape"], spec["init"]))
    assert any(name.startswith(("vpm.", "resampler.")) for name in specs)
