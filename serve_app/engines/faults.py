"""Fault injection for reliability tests: off unless ``engine_options.fault_injection`` is set.

A stream whose text contains one of the configured markers misbehaves once it has sent
``after_chunks`` chunks, so tests and ``scripts/soak`` can break the real engine on purpose:

- ``fail_request_text``: the stream ends with an :class:`EngineError` (the others go on);
- ``crash_process_text``: the engine's whole process exits at once (``os._exit``), as a crashed
  GPU worker would;
- ``stall_request_text``: the stream never gets a chunk, though it holds its slot (a stuck
  engine, for timeouts);
- ``delay_request_text``: the stream waits ``delay_s`` before each chunk (a slow engine, for
  wall-clock limits and held streams).

``after_chunks`` applies to ``fail`` and ``crash``, so they strike mid-stream by default.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal, Mapping

logger = logging.getLogger(__name__)

FaultAction = Literal["fail", "crash", "stall", "delay"]
CRASH_EXIT_CODE = 70


@dataclass(frozen=True)
class FaultInjection:
    fail_request_text: str | None = None
    crash_process_text: str | None = None
    stall_request_text: str | None = None
    delay_request_text: str | None = None
    delay_s: float = 1.0
    after_chunks: int = 1

    @classmethod
    def from_options(cls, raw: "FaultInjection | Mapping[str, Any] | None"
                     ) -> "FaultInjection | None":
        """None (injection off) for None or an empty mapping; unknown keys are an error."""
        if raw is None or isinstance(raw, FaultInjection):
            return raw
        if not raw:
            return None
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown fault_injection options: {sorted(unknown)}")
        faults = cls(**raw)
        logger.warning("fault injection is ON: %s", faults)
        return faults

    def action(self, text: str, chunks_sent: int) -> FaultAction | None:
        """What to do to a stream with ``text`` that has sent ``chunks_sent`` chunks."""
        if chunks_sent >= self.after_chunks:
            if self.crash_process_text and self.crash_process_text in text:
                return "crash"
            if self.fail_request_text and self.fail_request_text in text:
                return "fail"
        if self.stall_request_text and self.stall_request_text in text:
            return "stall"
        if self.delay_request_text and self.delay_request_text in text:
            return "delay"
        return None


def crash_process(request_id: str) -> None:
    """Exit the process now, skipping every cleanup handler, as a hard crash would."""
    logger.critical("fault injection: crashing this process (request %s)", request_id)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(CRASH_EXIT_CODE)
