"""The soak's memory trend (soak/memory.py) and its refusal count (soak/run.py):
the slope is a least-squares fit after the warm-up, per process, read from real processes."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from soak.memory import MemorySampler, slope_per_min
from soak.run import is_refusal

# A process whose title carries a replica's marker (as Serve's replicas' do) and whose memory
# grows by 8 MiB each time it reads a line.
GROWER = """
import sys
held = []
for _ in sys.stdin:
    held.append(b"x" * (8 * 2**20))
    print(len(held), flush=True)
"""


def test_slope_is_the_least_squares_fit_in_mb_a_minute() -> None:
    assert slope_per_min([(0, 100.0), (60, 101.0), (120, 102.0)]) == pytest.approx(1.0)
    assert slope_per_min([(0, 100.0), (30, 100.0), (60, 100.0)]) == pytest.approx(0.0)
    # Noise around a flat line: 100, 101, 100, 101 over 3 minutes.
    assert slope_per_min([(0, 100), (60, 101), (120, 100), (180, 101)]) == pytest.approx(0.2)
    assert slope_per_min([(0, 100.0), (60, 101.0)]) is None
    assert slope_per_min([(60, 100.0), (60, 101.0), (60, 102.0)]) is None


def test_sampler_fits_each_replica_after_the_warm_up_only() -> None:
    app = "soakmemtest"
    grower = subprocess.Popen([sys.executable, "-c", GROWER, f"ServeReplica:{app}:Ingress"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        now = [0.0]
        sampler = MemorySampler(app, lambda: now[0], every_s=60, warmup_s=120)
        for minute in range(6):
            now[0] = 60.0 * minute
            if minute >= 2:  # flat in the warm-up, then 8 MiB more a minute
                grower.stdin.write("grow\n")
                grower.stdin.flush()
                grower.stdout.readline()
            time.sleep(0.05)
            sampler.by_deployment()
        report = sampler.report()
    finally:
        grower.kill()
        grower.wait()
    [replica] = [r for r in report["replicas"] if r["pid"] == grower.pid]
    assert replica["deployment"] == "Ingress" and replica["samples_after_warmup"] == 4
    assert len(replica["samples_t_s_mb"]) == 6
    assert replica["slope_mb_per_min_after_warmup"] == pytest.approx(8.0, abs=0.5)
    assert report["ingress_rss_slope_mb_per_min"] == replica["slope_mb_per_min_after_warmup"]


def test_only_an_overloaded_503_with_retry_after_is_a_refusal() -> None:
    overloaded = {"error": {"code": "overloaded", "type": "service_unavailable",
                            "message": "the service is at capacity"}}
    assert is_refusal(httpx.Response(503, json=overloaded, headers={"Retry-After": "1"}))
    assert not is_refusal(httpx.Response(503, json=overloaded))
    unavailable = {"error": {"code": "synthesis_unavailable", "message": "retry shortly"}}
    assert not is_refusal(httpx.Response(503, json=unavailable, headers={"Retry-After": "1"}))
    assert not is_refusal(httpx.Response(503, text="busy", headers={"Retry-After": "1"}))
    assert not is_refusal(httpx.Response(429, json=overloaded, headers={"Retry-After": "1"}))
