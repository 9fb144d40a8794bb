"""The application graph: ``Ingress -> Synthesizer``, built from typed args.

``serve run serve_config.yaml`` imports :func:`build_app`; per-deployment resources, replicas and
autoscaling live in the YAML's ``deployments`` section, not here.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from serve_app.config import AppArgs
from serve_app.front.ingress import Ingress
from serve_app.gpu.synthesizer import Synthesizer


# Each speech stream goes to a replica whose engine has room for its work (gpu/routing.py); the
# replicas report their room twice a second.
WORK_ROUTING = RequestRouterConfig(request_router_class="serve_app.gpu.routing:WorkRouter",
                                   request_routing_stats_period_s=0.5,
                                   request_routing_stats_timeout_s=2.0)


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """Bind the two deployments; the batching knobs become the synthesizer's user_config.

    The arguments are checked here, engine_options included, so a bad config fails ``serve
    run`` before any replica starts. The Synthesizer takes as many requests at once
    (``max_ongoing_requests``, :attr:`AppArgs.max_ongoing_requests`) as its engine can hold
    when it admits by work, so the engine refuses at once what it cannot serve in real time;
    as it has slots when it admits by slots (more would only wait in the engine's queue, out
    of the router's sight). A ``max_ongoing_requests`` in the YAML's ``deployments`` section
    still wins (Serve applies it over this one): set it there only to mean a different number
    (serve_config.cpu.yaml).
    The Synthesizer's router sends each stream to a replica with room for its work
    (:data:`WORK_ROUTING`)."""
    app_args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    api = app_args.api
    synthesizer = Synthesizer.options(
        user_config=app_args.batching.model_dump(),
        max_ongoing_requests=app_args.max_ongoing_requests,
        request_router_config=WORK_ROUTING,
    ).bind(
        app_args.engine, app_args.engine_kwargs(), first_chunk_timeout_s=api.first_chunk_timeout_s,
        chunk_timeout_s=api.chunk_timeout_s, drain_timeout_s=api.drain_timeout_s,
        voice_store=api.voice_store)
    return Ingress.bind(synthesizer, app_args.api.model_dump())
