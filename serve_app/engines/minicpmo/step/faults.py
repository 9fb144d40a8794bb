"""Fault injection in the step (tests only): streams whose text holds a marker fail or crash
the process (:mod:`serve_app.engines.faults` has the markers and when they strike)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from ...base import EngineError
from ...faults import FaultInjection, crash_process
from ..scheduler import Stream

logger = logging.getLogger(__name__)


def inject_faults(faults: FaultInjection, streams: Iterable[Stream],
                  fail: Callable[[Stream, BaseException], None]) -> None:
    """Fail (with ``fail``) or crash the streams that ``faults`` strike now."""
    for stream in streams:
        action = faults.action(stream.plan.request.text, stream.chunks_sent)
        if action == "crash":
            crash_process(stream.request_id)
        elif action == "fail":
            logger.error("request %s failed: injected fault", stream.request_id)
            fail(stream, EngineError("speech synthesis failed (injected fault)"))
