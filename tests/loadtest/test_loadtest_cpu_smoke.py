"""CI smoke: scripts/loadtest for 10 s against the CPU profile as scripts/serve serves it.

The service is ``scripts/serve_run.py serve_config.cpu.yaml`` (``serve run`` on a free port, its
own local Ray) in a process group of its own, shared with the other tests on the CPU profile
(tests/cpu_profile.py); every process it started is ended afterwards.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.cpu_profile import CpuProfileService

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_loadtest_10s_on_the_cpu_profile_has_throughput_and_no_failures(
        cpu_service: CpuProfileService, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "loadtest"), "--host", cpu_service.url, "--duration", "10",
         "--users", "4", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
        timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["load_s"] == 10 and summary["users"] == 4
    # admission by work may refuse a stream on a busy machine: a refusal is no failure
    assert summary["successes"] > 0 and summary["refused"] >= 0
    assert summary["requests_per_s"] > 0 and summary["audio_seconds_per_s"] > 0
    assert summary["failures"] == 0 and summary["error_rate"] == 0.0
    ttfb = summary["ttfb_ms"]
    assert 0 < ttfb["p50"] <= ttfb["p90"] <= ttfb["p99"]
    for name in ("locust.html", "locust_stats.csv", "summary.png"):
        assert (tmp_path / name).stat().st_size > 0, name
