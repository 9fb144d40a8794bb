"""Phase timing: each engine step's time by phase (the names ``scripts/roofline.py`` reads)."""

from __future__ import annotations

import collections
import time

import torch

from ..options import EngineOptions


class PhaseClock:
    """Accounts the step's time to its phases: :meth:`lap` gives the time since the last lap (or
    :meth:`start`) to a phase, in this step's record and, with ``profile_phases``, in the running
    totals too (profiling synchronises the GPU at each lap, so that a phase's device work is
    counted in it rather than in the next phase that waits)."""

    def __init__(self, options: EngineOptions, device: torch.device) -> None:
        self._options = options
        self._device = device
        self.totals: dict[str, float] = collections.defaultdict(float)  # profiled, all steps
        # host time by phase, all steps, profiled or not: what the served engine reports
        # (``Engine.step_phase_seconds``) beside bench_engine's ``step_phase_ms``
        self.host_totals: dict[str, float] = {}
        self._step: dict[str, float] = collections.defaultdict(float)
        self._mark = 0.0

    def start(self) -> None:
        """A step begins: the first phase counts from now."""
        self._mark = time.perf_counter()

    def lap(self, name: str) -> None:
        """The time since the last lap to phase ``name``."""
        profiling = self._options.profile_phases
        if profiling and self._device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self._step[name] += now - self._mark
        self.host_totals[name] = self.host_totals.get(name, 0.0) + (now - self._mark)
        if profiling:
            self.totals[name] += now - self._mark
        self._mark = now

    def take_step(self) -> tuple[tuple[str, float], ...]:
        """The step's seconds by phase, in the order the phases first ran; the next step's
        start from none."""
        phases = tuple(self._step.items())
        self._step = collections.defaultdict(float)
        return phases
