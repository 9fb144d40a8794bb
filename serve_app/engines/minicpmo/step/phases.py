"""Phase timing: each engine step's time by phase (the names ``bench/engine/roofline.py`` reads)."""

from __future__ import annotations

import collections
import time

import torch

from ..options import EngineOptions


class PhaseClock:
    """Accounts the step's time to its phases: :meth:`lap` gives the time since the last lap (or
    :meth:`start`) to a phase, in this step's record and in the running totals (with
    ``profile_phases`` it synchronises the GPU at each lap, so that a phase's device work is
    counted in it rather than in the next phase that waits)."""

    def __init__(self, options: EngineOptions, device: torch.device) -> None:
        self._options = options
        self._device = device
        # all steps' time by phase (device time included only with ``profile_phases``); the
        # served engine reports it (``Engine.step_phase_seconds``) beside bench_engine's
        self.totals: dict[str, float] = collections.defaultdict(float)
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
        self.totals[name] += now - self._mark
        self._mark = now

    def take_step(self) -> tuple[tuple[str, float], ...]:
        """The step's seconds by phase, in the order the phases first ran; the next step's
        start from none."""
        phases = tuple(self._step.items())
        self._step = collections.defaultdict(float)
        return phases
