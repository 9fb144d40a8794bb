"""The CPU profile as ``scripts/serve`` serves it, started once for the tests that need it.

``scripts/serve_run.py serve_config.cpu.yaml`` (what ``scripts/serve`` runs without a GPU) in
a process group of its own, on its own local Ray, on a free HTTP port, metrics port and HAProxy
ports, with a marker in its environment so that every process it started is ended afterwards.

Three tests run against it: the load-test smoke (tests/loadtest/test_loadtest_cpu_smoke.py), the
README's commands (tests/test_readme.py) and, last, Ctrl-C (tests/test_serve_ctrl_c.py), which
takes the service over, stops it and reads its whole log. Each start of the profile costs a
local Ray cluster, Serve, HAProxy and the replicas (12-30 s, and again 5-10 s to stop); one start
serves all three. tests/conftest.py runs these tests at the end of the session, one after
another, the Ctrl-C one last; run alone, each gets a service of its own.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness.local_ray import end_marked_processes, free_ports
from harness.service import answers_ready
from serve_app.ingress_env import HAPROXY_PORT_SETTINGS, INGRESS_DRAIN_SETTING

ROOT = Path(__file__).resolve().parents[1]
MARKER = "CPU_PROFILE_TEST_SERVICE"


@dataclass
class CpuProfileService:
    url: str
    port: int
    process: subprocess.Popen
    log_path: Path
    marker: str

    def end(self) -> None:
        """SIGKILL what is still running, then every process the marker names (Ray's HAProxy
        outlives its cluster: re-parented, in a process group of its own)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        end_marked_processes(MARKER, self.marker, grace_s=5.0)

    def stop(self) -> None:
        """Ctrl-C, as a terminal sends it (to the whole foreground process group), then
        :meth:`end`."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        self.end()


def _serve_run(config_path: Path, metrics_port: int, env: dict[str, str],
               log_path: Path) -> subprocess.Popen:
    with log_path.open("w") as log:
        return subprocess.Popen(
            [sys.executable, "scripts/serve_run.py", str(config_path),
             "--metrics-port", str(metrics_port)], cwd=ROOT, env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)


def start_cpu_profile(folder: Path) -> CpuProfileService:
    """``scripts/serve_run.py`` on the CPU profile, answering ``/readyz``."""
    port, metrics_port, *haproxy_ports = free_ports(2 + len(HAPROXY_PORT_SETTINGS))
    config = yaml.safe_load((ROOT / "serve_config.cpu.yaml").read_text(encoding="utf-8"))
    config["http_options"]["port"] = port
    config_path = folder / "serve_config.cpu.yaml"
    config_path.write_text(yaml.safe_dump(config))
    marker = secrets.token_hex(8)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", MARKER: marker,
           # beside any other cluster on this machine
           **{name: str(value) for name, value in zip(HAPROXY_PORT_SETTINGS, haproxy_ports)}}
    env.pop("RAY_ADDRESS", None)  # its own local Ray, as scripts/serve starts it
    env.pop(INGRESS_DRAIN_SETTING, None)  # serve_run.py's own, as scripts/serve runs it
    url = f"http://127.0.0.1:{port}"
    # Ray's start-up deadlines (agent ports ~15 s, raylet registration 30 s) are fixed; a
    # machine busy with other work can miss them, so a start that never gets ready is retried.
    for attempt in (1, 2, 3):
        log_path = folder / f"serve-{attempt}.log"
        service = CpuProfileService(url, port, _serve_run(config_path, metrics_port, env,
                                                          log_path), log_path, marker)
        if answers_ready(service.process, url, timeout_s=600):
            return service
        service.end()
        assert attempt < 3, f"never ready:\n{log_path.read_text(errors='replace')[-3000:]}"
    raise AssertionError("unreachable")


class CpuProfile:
    """The session's one CPU-profile service: started by the first test that asks for it,
    shared until a test takes it over (:meth:`take`), stopped at the end of the session."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._starts = 0
        self._service: CpuProfileService | None = None

    def _start(self) -> CpuProfileService:
        self._starts += 1
        folder = self._folder / f"service-{self._starts}"
        folder.mkdir()
        return start_cpu_profile(folder)

    def service(self) -> CpuProfileService:
        """The running service (started now if there is none, or it has ended)."""
        if self._service is not None and self._service.process.poll() is not None:
            self._service.end()
            self._service = None
        if self._service is None:
            self._service = self._start()
        return self._service

    def take(self) -> CpuProfileService:
        """The running service, handed over: the taker stops it; a later test gets a new one."""
        service, self._service = self.service(), None
        return service

    def close(self) -> None:
        if self._service is not None:
            self._service.stop()
            self._service = None
