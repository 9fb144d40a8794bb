"""CI smoke: scripts/loadtest for 10 s against the CPU profile served by `serve run`.

The service is `serve run serve_config.cpu.yaml` (on a free port, its own local Ray) in a
subprocess, as scripts/serve runs it; every process it started is ended afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from loadtest.local_cluster import end_marked_processes, free_ports
from loadtest.service import answers_ready

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MARKER = "LOADTEST_SMOKE_SERVICE"


def _serve_run(config_path: Path, log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    with log_path.open("w") as log:
        # --address local: a Ray of its own, never one already running on this machine.
        return subprocess.Popen(
            [str(Path(sys.executable).parent / "serve"), "run", "--address", "local",
             str(config_path)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)


def _stop(service: subprocess.Popen) -> None:
    service.send_signal(signal.SIGINT)  # serve run: shut Serve down, then its Ray
    try:
        service.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(service.pid, signal.SIGKILL)
        service.wait()


@pytest.fixture(scope="module")
def cpu_service(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("cpu-service")
    [port] = free_ports(1)
    config = yaml.safe_load((ROOT / "serve_config.cpu.yaml").read_text())
    config["http_options"]["port"] = port
    config_path = folder / "serve_config.cpu.yaml"
    config_path.write_text(yaml.safe_dump(config))
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    url = f"http://127.0.0.1:{port}"
    try:
        # Ray's start-up deadlines (agent ports ~15 s, raylet registration 30 s) are fixed; a
        # machine busy with other work can miss them, so retry.
        for attempt in (1, 2, 3):
            log_path = folder / f"serve-{attempt}.log"
            service = _serve_run(config_path, log_path, env)
            if answers_ready(service, url, 240):
                break
            _stop(service)
            assert attempt < 3, f"never ready:\n{log_path.read_text()[-3000:]}"
        yield url
        _stop(service)
    finally:
        end_marked_processes(MARKER, marker)


@pytest.mark.timeout(600)
def test_loadtest_10s_on_the_cpu_profile_has_throughput_and_no_failures(
        cpu_service: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "loadtest"), "--host", cpu_service, "--duration", "10",
         "--users", "4", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
        timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["load_s"] == 10 and summary["users"] == 4
    assert summary["successes"] > 0
    assert summary["requests_per_s"] > 0 and summary["audio_seconds_per_s"] > 0
    assert summary["failures"] == 0 and summary["error_rate"] == 0.0
    ttfb = summary["ttfb_ms"]
    assert 0 < ttfb["p50"] <= ttfb["p90"] <= ttfb["p99"]
    for name in ("locust.html", "locust_stats.csv", "summary.png"):
        assert (tmp_path / name).stat().st_size > 0, name
