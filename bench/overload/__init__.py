"""Overload: each mix offered at 0.5-3x its capacity, served (``scripts/bench_overload``) and on
the engine alone, admission by work beside admission by slots."""
