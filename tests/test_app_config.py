"""The application's args drive its deployments: ``engine_options`` typed per engine and checked
when ``serve run`` builds the app (before any replica starts, without torch), and the
Synthesizer's ``max_ongoing_requests`` derived from the engine's slots. No Ray cluster: the built
:class:`~ray.serve.Application` is inspected as is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from serve_app.app import build_app
from serve_app.config import AppArgs, BatchingConfig
from serve_app.engines.minicpmo.options import EngineOptions
from serve_app.engines.piper.options import PiperOptions

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return set(out.split())


def test_the_minicpmo_options_import_without_torch() -> None:
    loaded = _modules_after("import serve_app.engines.minicpmo.options")
    assert "serve_app.engines.minicpmo.options" in loaded
    assert "torch" not in loaded
    assert "serve_app.engines.minicpmo.engine" not in loaded


def test_building_the_app_args_loads_neither_engine() -> None:
    """The front (and ``serve run``'s build) reads the args without torch or onnxruntime."""
    loaded = _modules_after("from serve_app.config import AppArgs\n"
                            "AppArgs.model_validate({'engine': 'minicpmo', "
                            "'engine_options': {'max_slots': 8}})")
    assert not {"torch", "onnxruntime", "piper"} & loaded


def _synthesizer(app):
    """The Synthesizer deployment bound under the Ingress of ``build_app``'s Application."""
    [synthesizer] = [arg for arg in app._bound_deployment.init_args
                     if getattr(arg, "_bound_deployment", None) is not None]
    return synthesizer._bound_deployment


@pytest.mark.parametrize(("args", "ongoing"), [
    # admitting by work: every stream the engine holds (slots and queue) and as many again on
    # their way to a refusal, so the engine refuses at once what it cannot serve in real time,
    # not Serve's queue at the caller
    ({"engine": "minicpmo", "engine_options": {"max_slots": 12, "max_chat_slots": 4,
                                                "max_queued": 20}}, 2 * 32),
    ({"engine": "piper", "engine_options": {"max_batch_size": 3}}, 2 * (3 + 256)),
    ({}, 2 * (PiperOptions.max_batch_size + PiperOptions.max_queued_streams)),
    # admitting by slots: as many as its slots (more would only wait in its queue)
    ({"engine": "minicpmo", "engine_options": {"max_slots": 12, "max_chat_slots": 4,
                                                "admission": "slots"}}, 12),
    ({"engine": "piper", "engine_options": {"max_batch_size": 3, "admission": "slots"}}, 3),
])
def test_the_synthesizer_takes_the_requests_its_engine_decides_on(args, ongoing) -> None:
    synthesizer = _synthesizer(build_app(args))
    assert synthesizer.name == "Synthesizer"
    assert synthesizer.max_ongoing_requests == ongoing


def test_every_shipped_config_builds_with_typed_options() -> None:
    for path in sorted(ROOT.glob("serve_config*.yaml")):
        [app] = yaml.safe_load(path.read_text(encoding="utf-8"))["applications"]
        args = AppArgs.model_validate(app["args"])
        expected = {"minicpmo": EngineOptions, "piper": PiperOptions}[args.engine]
        assert type(args.engine_options) is expected, path.name
        synthesizer = _synthesizer(build_app(app["args"]))
        deployment = {d["name"]: d for d in app["deployments"]}["Synthesizer"]
        assert synthesizer.max_ongoing_requests == args.max_ongoing_requests, path.name
        # the YAML sets one only to mean another number (it wins over the derived one)
        assert deployment.get("max_ongoing_requests") != args.max_ongoing_requests, path.name


def test_no_shipped_config_asks_for_more_batches_than_its_replica_can_fill() -> None:
    """Serve warns when a deployment's ``max_batch_size`` x ``max_concurrent_batches`` exceeds
    its ``max_ongoing_requests`` (ray/serve/batching.py, ``_BatchQueue``): the replica never
    holds enough requests to fill them. No shipped config may make it warn."""
    for path in sorted(ROOT.glob("serve_config*.yaml")):
        [app] = yaml.safe_load(path.read_text(encoding="utf-8"))["applications"]
        deployment = {d["name"]: d for d in app["deployments"]}["Synthesizer"]
        batching = BatchingConfig.model_validate(deployment.get("user_config") or {})
        ongoing = (deployment.get("max_ongoing_requests")
                   or _synthesizer(build_app(app["args"])).max_ongoing_requests)
        assert batching.max_batch_size * batching.max_concurrent_batches <= ongoing, path.name


def test_the_benchmark_keys_are_engine_options() -> None:
    args = AppArgs.model_validate({"engine": "minicpmo", "engine_options": {
        "gpu_memory_gb": 38.0, "benchmark": {"random_weights": True}, "max_slots": 160}})
    assert args.engine_options.benchmark == {"random_weights": True}
    assert args.engine_kwargs()["gpu_memory_gb"] == 38.0
    assert EngineOptions.from_raw(args.engine_kwargs()) == args.engine_options


@pytest.mark.parametrize(("args", "says"), [
    ({"engine": "minicpmo", "engine_options": {"max_slot": 64}},
     "'max_slot' (did you mean 'max_slots'?)"),
    ({"engine": "minicpmo", "engine_options": {"max_slots": "many"}}, "max_slots: Input should"),
    ({"engine": "minicpmo", "engine_options": {"voices": "yes"}}, "voices: Input should"),
    ({"engine": "minicpmo", "engine_options": {"quantization": "fp8"}},
     "quantization must be one of"),
    ({"engine": "minicpmo", "engine_options": {"max_slots": 0}}, "max_slots: Input should be"),
    # another engine's option
    ({"engine": "piper", "engine_options": {"max_slots": 8}}, "unknown engine options"),
    ({"engine": "minicpmo", "engine_options": {"max_batch_size": 8}}, "'max_batch_size'"),
    ({"engine": "piper", "engine_options": {"max_batch_size": 0}}, "max_batch_size"),
    ({"engine": "piper", "engine_options": ["max_batch_size"]}, "must be a mapping"),
    ({"engine": "nope"}, "unknown engine 'nope'"),
])
def test_a_bad_engine_option_is_refused_when_the_app_is_built(args, says) -> None:
    """``serve run`` calls build_app with the YAML's args: the error comes from there, naming
    the engine and the option, before any replica (or torch) is started."""
    with pytest.raises(ValidationError) as refused:
        build_app(args)
    assert says in str(refused.value)
    if args.get("engine") in ("piper", "minicpmo"):
        assert f"engine_options of the {args['engine']} engine" in str(refused.value)


def test_options_of_the_other_engine_are_refused() -> None:
    with pytest.raises(ValidationError, match="piper engine"):
        AppArgs(engine="piper", engine_options=EngineOptions())
    assert AppArgs(engine="minicpmo", engine_options=EngineOptions(max_slots=5)).max_slots == 5
