"""Autoscaling of the Synthesizer (GPU) replicas on the engine's own queue.

Ray Serve's default policy counts ongoing requests per replica. A speech engine knows more, and
each Synthesizer replica reports it (``Synthesizer.record_autoscaling_stats``, averaged by Serve
over ``look_back_period_s``):

- ``waiting_streams``: streams accepted but not yet in an engine slot (waiting for their
  ``@serve.batch`` admission or for a free slot). Any sustained wait adds TTFB directly. The
  policy adds the requests Serve holds queued at the callers' handles (a replica whose
  ``max_ongoing_requests`` is reached never sees them).
- ``slot_occupancy``: streams in engine slots over the engine's slots, 0..1.
- ``step_budget_used``: the engine's time per step over the audio each stream gets from one
  step (its real-time budget), 0..; 1 means the engine only just keeps real time. It rises
  before TTFB breaks: a new stream's first chunk takes several steps, so TTFB grows with the
  step time long before any stream runs dry. (0 when the engine reports no budget: Piper.)
- ``work_demand``: the work offered to the engine over the work its admission lets in
  (serve_app/engines/work_admission.py): the load its streams commit plus the load of the
  streams it refused since the last report, over its limit, 0..; above 1 means it is refusing
  work. Admission by work keeps the engine itself under its limit, so this is the signal that
  sees refused work as demand. (0 when the engine admits by slots.)

:class:`EngineQueuePolicy` wants as many replicas as the largest of four demands:
occupancy over ``target_occupancy``, step budget over ``target_step_budget``, work demand over
``target_work``, and one more replica while streams wait (above ``waiting_streams_per_replica``
per replica). It scales in
only when every signal says the remaining replicas would be below their targets, and Serve
applies ``min_replicas`` / ``max_replicas``, ``upscale_delay_s`` and ``downscale_delay_s``
around it (the policy's answer is only a wish; a scale-in must be wished for
``downscale_delay_s`` in a row). A running replica that has stopped reporting (starting,
stuck, or gone) never counts as idle: while one is silent the policy does not scale in. With
no reports at all it falls back on Serve's own rule, ongoing requests over
``target_ongoing_requests``.

Named in ``serve_config.yaml`` as the Synthesizer's ``autoscaling_config.policy``
(``policy_function: serve_app.gpu.autoscaling:EngineQueuePolicy``, ``policy_kwargs``). No Ray
import here: the controller calls it with Serve's ``AutoscalingContext``, tests with their own.
"""

from __future__ import annotations

import math
from typing import Any

WAITING_STREAMS = "waiting_streams"
SLOT_OCCUPANCY = "slot_occupancy"
STEP_BUDGET_USED = "step_budget_used"
WORK_DEMAND = "work_demand"
SIGNALS = (WAITING_STREAMS, SLOT_OCCUPANCY, STEP_BUDGET_USED)  # every report has these
OPTIONAL_SIGNALS = (WORK_DEMAND,)  # 0 where absent (an engine that admits by slots)


class EngineQueuePolicy:
    """Serve's custom autoscaling policy over the engines' reports (module docstring)."""

    def __init__(self, target_occupancy: float = 0.75, target_step_budget: float = 0.6,
                 waiting_streams_per_replica: float = 1.0, scale_in_margin: float = 0.8,
                 target_work: float = 0.8) -> None:
        if not 0 < target_occupancy <= 1:
            raise ValueError("target_occupancy must be in (0, 1]")
        if not target_step_budget > 0:
            raise ValueError("target_step_budget must be positive")
        if not 0 < scale_in_margin <= 1:
            raise ValueError("scale_in_margin must be in (0, 1]")
        if not target_work > 0:
            raise ValueError("target_work must be positive")
        self.target_work = target_work
        self.target_occupancy = target_occupancy
        self.target_step_budget = target_step_budget
        self.waiting_streams_per_replica = waiting_streams_per_replica
        self.scale_in_margin = scale_in_margin

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        """The replicas wanted now (Serve bounds and delays it), and a note of why."""
        running = list(ctx.running_replicas)
        current = max(ctx.current_num_replicas, 1)
        reports = _reports(ctx.aggregated_metrics or {}, running)
        if not reports:
            return _ongoing_requests_rule(ctx), {"basis": "ongoing_requests"}
        occupancy = sum(r.get(SLOT_OCCUPANCY, 0.0) for r in reports.values())
        budget = max(r.get(STEP_BUDGET_USED, 0.0) for r in reports.values())
        waiting = (sum(r.get(WAITING_STREAMS, 0.0) for r in reports.values())
                   + (ctx.total_queued_requests or 0.0))
        wants = {
            # Occupancy: each reporting replica's share, summed, over the target share.
            "occupancy": occupancy / self.target_occupancy,
            # The busiest engine's step over its budget, scaled to the replicas there are.
            "step_budget": current * budget / self.target_step_budget,
            # Work admitted and refused, summed over the replicas, over the target share.
            "work": sum(r.get(WORK_DEMAND, 0.0) for r in reports.values()) / self.target_work,
            "waiting": (current + 1 if waiting > self.waiting_streams_per_replica * len(reports)
                        else 0),
        }
        desired = max(wants.values())
        silent = len(running) - len(reports)
        if desired < current:
            if silent > 0:
                desired = current  # a silent replica may be busy: never scale in on a guess
            elif not self._idle_enough(desired, current):
                desired = current
        note = {"basis": max(wants, key=wants.get), "silent_replicas": silent,
                **{f"want_{name}": round(value, 3) for name, value in wants.items()}}
        return desired, note

    def _idle_enough(self, desired: float, current: int) -> bool:
        """Scale in only when the replicas left would run below their targets with a margin:
        the load the removed replicas carried, spread over the rest, still leaves room."""
        left = max(math.ceil(desired), 1)
        return desired <= left * self.scale_in_margin and left < current


def _reports(metrics: dict[str, dict[Any, float]], running: list[Any]) -> dict[Any, dict]:
    """Per running replica that reported every signal, its values."""
    reports: dict[Any, dict[str, float]] = {}
    for replica in running:
        values = {name: metrics.get(name, {}).get(replica) for name in SIGNALS}
        if all(value is not None for value in values.values()):
            reports[replica] = {name: float(value) for name, value in values.items()}
            for name in OPTIONAL_SIGNALS:
                reports[replica][name] = float(metrics.get(name, {}).get(replica) or 0.0)
    return reports


def _ongoing_requests_rule(ctx: Any) -> float:
    """Serve's default: ongoing requests over the target per replica."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas
    target = ctx.config.get_target_ongoing_requests() * ctx.current_num_replicas
    return ctx.current_num_replicas * ctx.total_num_requests / target


def engine_signals(now: Any, before: Any, waiting_for_admission: int) -> dict[str, float]:
    """The four signals a Synthesizer replica reports, from its engine's ``EngineStats`` now
    and at its last report (``before``, None for the first): the step time is the mean over the
    steps run in between (0 when none ran: an idle engine uses none of its budget)."""
    slots = now.max_slots or 1
    steps = now.steps - (before.steps if before is not None else 0)
    busy_s = now.step_seconds - (before.step_seconds if before is not None else 0.0)
    step_s = busy_s / steps if steps > 0 else 0.0
    budget = step_s / now.step_budget_s if now.step_budget_s > 0 else 0.0
    refused = now.refused_load - (before.refused_load if before is not None else 0.0)
    demand = (now.work_load + refused) / now.work_limit if now.work_limit > 0 else 0.0
    return {WAITING_STREAMS: float(waiting_for_admission + now.queued_streams),
            SLOT_OCCUPANCY: now.active_streams / slots,
            STEP_BUDGET_USED: budget, WORK_DEMAND: demand}
