"""How scripts/bench_engine.py counts real-time streams: a level counts only when every arrival
measured at it was real-time (a burst that passes does not make up for a Poisson run that fails)."""

from scripts.bench_engine import realtime_streams


def _row(concurrency: int, arrival: str, ok: bool) -> dict:
    return {"mode": "chat", "concurrency": concurrency, "arrival": arrival, "ok": ok}


def test_a_level_counts_only_when_all_its_arrivals_are_realtime():
    rows = [_row(32, "burst", True), _row(32, "poisson", True),
            _row(64, "burst", True), _row(64, "poisson", False)]
    assert realtime_streams(rows, floor=1) == 32
    assert realtime_streams([r for r in rows if r["arrival"] == "burst"], floor=1) == 64
    assert realtime_streams([r for r in rows if r["arrival"] == "poisson"], floor=1) == 32


def test_no_level_realtime_leaves_the_single_stream_floor():
    rows = [_row(32, "poisson", False)]
    assert realtime_streams(rows, floor=1) == 1
    assert realtime_streams(rows) == 0
