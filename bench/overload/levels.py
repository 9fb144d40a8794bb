"""The overload benchmark's arrivals, what one stream's fate is, and a level's summary: shared
by the served run (``bench/overload/run.py``, HTTP) and the engine alone
(``bench/overload/engine.py``), so both count the same way.

A level offers ``offered_x`` times a mix's capacity: Poisson arrivals for ``window_s`` at
``offered_x`` x the rate that holds the mix's capacity of streams (``capacity / audio_s`` a
second; a mix of read and chat at its ratio). Each stream is then one of:

- **refused**: a 503 or 429 before any audio (its latency, status and whether it said
  ``Retry-After``);
- **admitted**: audio came; **real-time** if its audio never ran dry at the listener (each
  byte came before the audio before it had played, 1 ms of slack, as ``locustfile.py``'s
  listeners count) and it ended whole; **cut** if it ended early after its first byte;
- **failed**: anything else (an error status that is not a refusal, no answer).

**Goodput** is the real-time streams a second of the window, and their audio seconds a second.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

MIXES = {"read": {"read": 1}, "chat": {"chat": 1}, "mixed": {"read": 3, "chat": 1}}
LEVELS_X = (0.5, 1.0, 1.5, 2.0, 3.0)
REFUSAL_STATUSES = (429, 503)
DRY_SLACK_S = 1e-3


def arrivals(mix: str, capacity: dict[str, int], offered_x: float, window_s: float,
             audio_s: float, seed: int = 0) -> list[tuple[float, str]]:
    """(seconds after the start, kind) of each stream of a level: Poisson at ``offered_x`` x
    the rate that holds ``capacity`` streams of each kind (``capacity`` by kind: the mix's
    capacity, e.g. {"read": 384, "chat": 96})."""
    rng = random.Random(f"{mix}-{offered_x}-{seed}")
    out: list[tuple[float, str]] = []
    for kind, streams in capacity.items():
        rate = offered_x * streams / audio_s
        t = rng.expovariate(rate)
        while t < window_s:
            out.append((t, kind))
            t += rng.expovariate(rate)
    return sorted(out)


@dataclass
class StreamFate:
    """What happened to one offered stream (times in seconds from its arrival)."""

    kind: str
    at_s: float  # its arrival, seconds into the level
    status: int | None = None  # HTTP status (the engine alone: 200 admitted, 503 refused)
    answered_s: float | None = None  # the status (or the engine's refusal) came
    retry_after: bool = False
    first_audio_s: float | None = None
    last_audio_s: float | None = None  # its last audio came (the engine was done with it)
    audio_s: float = 0.0
    ran_dry: bool = False
    dry_at_s: float | None = None  # when it first ran dry, seconds after its first audio
    whole: bool = False  # ended as a stream should (final chunk / complete body)
    error: str | None = None
    request_id: str | None = None  # what it sent as x-request-id (served: its replica's log)

    def audio(self, now_s: float, seconds: float) -> None:
        """``seconds`` of audio arrived ``now_s`` after the arrival."""
        if seconds <= 0:
            return
        if self.first_audio_s is None:
            self.first_audio_s = now_s
        elif now_s - self.first_audio_s > self.audio_s + DRY_SLACK_S:
            if not self.ran_dry:
                self.dry_at_s = now_s - self.first_audio_s
            self.ran_dry = True
        self.audio_s += seconds
        self.last_audio_s = now_s

    @property
    def refused(self) -> bool:
        return self.first_audio_s is None and self.status in REFUSAL_STATUSES

    @property
    def admitted(self) -> bool:
        return self.first_audio_s is not None

    @property
    def realtime(self) -> bool:
        return self.admitted and self.whole and not self.ran_dry

    @property
    def cut(self) -> bool:
        return self.admitted and not self.whole

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(fates: list[StreamFate], mix: str, offered_x: float, window_s: float
              ) -> dict[str, Any]:
    """A level's figures (the fields ``docs/benchmarks/overload-*.json`` lists per level)."""
    admitted = [f for f in fates if f.admitted]
    refused = [f for f in fates if f.refused]
    good = [f for f in admitted if f.realtime]
    ttfb = [f.first_audio_s * 1000 for f in admitted]
    refusal_ms = [f.answered_s * 1000 for f in refused if f.answered_s is not None]
    statuses: dict[str, int] = {}
    for fate in refused:
        statuses[str(fate.status)] = statuses.get(str(fate.status), 0) + 1
    by_kind = {}
    for kind in sorted({f.kind for f in fates}):
        mine = [f for f in admitted if f.kind == kind]
        by_kind[kind] = {
            "offered": sum(f.kind == kind for f in fates), "admitted": len(mine),
            "refused": sum(f.kind == kind for f in refused),
            "realtime_share": sum(f.realtime for f in mine) / len(mine) if mine else None,
            "ttfb_ms_p50": percentile([f.first_audio_s * 1000 for f in mine], 50),
            "ttfb_ms_p99": percentile([f.first_audio_s * 1000 for f in mine], 99)}
    return {
        "mix": mix, "offered_x": offered_x, "window_s": window_s, "offered": len(fates),
        "goodput_streams_per_s": len(good) / window_s,
        "goodput_audio_s_per_s": sum(f.audio_s for f in good) / window_s,
        "admitted": len(admitted), "refused": len(refused),
        "failed": len(fates) - len(admitted) - len(refused),
        "admitted_realtime_share": len(good) / len(admitted) if admitted else None,
        "admitted_ttfb_ms_p50": percentile(ttfb, 50),
        "admitted_ttfb_ms_p99": percentile(ttfb, 99),
        "refusal_ms_p50": percentile(refusal_ms, 50),
        "refusal_ms_p99": percentile(refusal_ms, 99),
        "refusal_statuses": statuses,
        "refusals_with_retry_after": sum(f.retry_after for f in refused),
        "cut_after_first_byte": sum(f.cut for f in admitted),
        # when the late ones first ran dry (after their first audio) and arrived: at a ramp's
        # start or as the held streams grew old
        "late_dry_after_first_audio_s": [round(f.dry_at_s, 2) for f in admitted
                                         if f.dry_at_s is not None][:50],
        "late_arrived_at_s": [round(f.at_s, 2) for f in admitted if f.ran_dry][:50],
        "by_kind": by_kind,
        "errors": sorted({f.error for f in fates if f.error})[:5],
    }


def capacity_of(mix: str, read: int, chat: int, mixed: tuple[int, int]) -> dict[str, int]:
    """A mix's capacity in streams by kind: read alone, chat alone, or the mixed pair."""
    if mix == "read":
        return {"read": read}
    if mix == "chat":
        return {"chat": chat}
    return {"read": mixed[0], "chat": mixed[1]}


def level_schedules(args: Any) -> Iterator[tuple[str, dict[str, int], float,
                                                 list[tuple[float, str]]]]:
    """Each level a run offers, in order: (mix, its capacity, offered_x, its arrivals), from the
    runs' shared arguments (``mixes``, ``levels``, ``capacity_*``, ``window_s``,
    ``audio_seconds``)."""
    for mix in args.mixes:
        capacity = capacity_of(mix, args.capacity_read, args.capacity_chat,
                               tuple(args.capacity_mixed))
        for offered_x in args.levels:
            yield (mix, capacity, offered_x,
                   arrivals(mix, capacity, offered_x, args.window_s, args.audio_seconds))
