"""The app as users run it (``serve run CONFIG``) on a fresh local Ray, for drivers that load it.

:func:`start_service` runs ``serve run --address local`` in a process group of its own and waits
for ``/readyz``; :func:`stop_service` ends it as Ctrl-C would; :func:`replicas` finds an app's
replica processes (for their memory and CPU).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]


def start_service(config: dict[str, Any], base_url: str, log_path: Path,
                  ready_timeout_s: float = 300) -> subprocess.Popen:
    """``serve run`` of the config on a new local cluster, in its own process group."""
    config_file = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    yaml.safe_dump(config, config_file)
    config_file.close()
    log = log_path.open("w")
    process = subprocess.Popen(
        [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run",
         "--address", "local", config_file.name], cwd=ROOT, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    started = time.monotonic()
    deadline = started + ready_timeout_s
    next_note = started + 60
    try:
        while True:
            try:
                if httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200:
                    print(f"service ready after {time.monotonic() - started:.0f} s", flush=True)
                    return process
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the service did not start in {time.monotonic() - started:.0f} s;"
                                 f" the end of {log_path}:\n{_log_tail(log_path)}")
            if time.monotonic() > next_note:  # a slow start says so (and where it stands)
                print(f"waiting for the service: {time.monotonic() - started:.0f} s; the log "
                      f"ends:\n{_log_tail(log_path, 5)}", flush=True)
                next_note += 60
            time.sleep(1)
    except BaseException:
        stop_service(process)
        raise


def _log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of the service's log that are not readiness probes."""
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    kept = [line for line in text.splitlines() if "/readyz" not in line]
    return "\n".join(line[:400] for line in kept[-lines:])


def stop_service(process: subprocess.Popen) -> None:
    """Ctrl-C for ``serve run`` (it shuts Serve and its cluster down), then kill what is left."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def replicas(app: str) -> list[tuple[str, int, float]]:
    """(deployment, pid, resident MiB) of ``app``'s replica processes."""
    import psutil

    found = []
    marker = f"ServeReplica:{app}:"
    for process in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if marker in cmdline and process.info["memory_info"] is not None:
            # The process title may carry the method it runs: "Synthesizer.handle_request...".
            name = cmdline.split(marker, 1)[1].split()[0].split(".")[0]
            found.append((name, process.info["pid"], process.info["memory_info"].rss / 2**20))
    return found
