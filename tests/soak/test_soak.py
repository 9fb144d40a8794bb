"""scripts/soak for half a minute: mixed load, disconnects, bad requests, two overload bursts
that admission by work partly refuses, and one replica crash (the load goes on past the half
minute until the service has recovered from the crash)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serving.conftest import _free_port, ray_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DURATION_S = 30


def test_a_minute_of_mixed_load_with_a_crash_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # A port of its own, and no port sharing: another suite's service on a fixed port would
    # otherwise take some of this one's connections (RAY_ENV in conftest.py says how). Bursts of
    # 40 long streams: more than admission by work ever lets run on this profile (a stream's
    # cost never falls below a quarter of its prior's 1/8 of the budget: 35 at most,
    # serve_config.cpu.yaml), so some are refused however fast the machine. (Bursts of 12 were
    # refused only while submissions queued one behind another and the engine measured the
    # burst's load before it took the rest.)
    result = subprocess.run(
        [sys.executable, "-m", "soak.run", "--duration-s", str(DURATION_S),
         "--crash-at-s", "8", "--memory-every-s", "10", "--memory-warmup-s", "0",
         "--burst-every-s", "15", "--burst-size", "40", "--concurrency", "4",
         "--port", str(_free_port()),
         "--out", str(out), "--log", str(tmp_path / "serve.log")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **ray_env()})
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["lost"] == 0, report
    assert report["5xx_outside_crash_window"] == 0, report
    assert report["non_json_errors"] == 0 and report["bad_request_accepted"] == 0, report
    assert report["completed"] > 0 and report["client_disconnects"] > 0, report
    assert report["rejected_4xx"] > 0, report
    # each stream cut short is recorded with its time and route (the crash's are after it)
    assert len(report["errored_at"]) == min(report["errored"], 20), report
    assert all(e["at_s"] >= 0 and e["path"].startswith("/v1/") for e in report["errored_at"])
    crash = report["crash"]
    assert crash["recovered_at_s"] is not None, report
    assert set(crash["synthesizer_pids_after"]) != set(crash["synthesizer_pids_before"]), report
    assert report["memory_rss_mb"]["end"].get("Synthesizer"), report
    assert len(report["memory_rss_mb"]["timeline"]) >= 2, report
    # Refusals (503 JSON, Retry-After, code "overloaded") are counted apart from errors.
    assert report["bursts"]["count"] == 2 and report["refused"] > 0, report
    trend = report["memory_rss_mb"]["trend"]
    assert any(r["deployment"] == "Ingress" for r in trend["replicas"]), trend
    assert report["ingress_rss_slope_mb_per_min"] == trend["ingress_rss_slope_mb_per_min"]
    assert report["ingress_rss_slope_mb_per_min"] is not None, trend
    assert result.returncode == 0, result.stderr[-3000:]
