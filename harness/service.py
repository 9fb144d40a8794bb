"""The app as users run it (``serve run CONFIG``) on a fresh local Ray, for drivers that load it.

:func:`start_service` runs ``serve run --address local`` in a process group of its own and waits
for ``/readyz``; :func:`stop_service` ends it as Ctrl-C would; :func:`replicas` finds an app's
replica processes (for their memory and CPU); :func:`replica_states` counts the Synthesizer's
replicas by state, as Serve reports them.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from harness.local_ray import end_marked_processes, free_ports
from serve_app.ingress_env import HAPROXY_PORT_SETTINGS, local_cluster_env

ROOT = Path(__file__).resolve().parents[1]
SERVICE_MARKER = "LOCAL_SERVICE_ID"  # in the environment of every process a service started
# Ray's "View the dashboard at http://127.0.0.1:8265" line in the service's log.
DASHBOARD_URL = re.compile(r"View the dashboard at\s*\S*?(http://[0-9.]+:[0-9]+)")
APP_NAME = "tts"  # the app's name in the configs the measuring runs serve
DEPLOYMENT = "Synthesizer"


def haproxy_env_of_its_own() -> dict[str, str]:
    """HAProxy in front on stats, metrics and fallback ports free now, and a stopping Ingress
    reachable 2 s: for a local cluster that shares the machine with others (tests, benchmarks)
    and has no balancer but its HAProxy (``serve_app/ingress_env.py``)."""
    return local_cluster_env(free_ports(len(HAPROXY_PORT_SETTINGS)))


def haproxy_files_in(directory: Path) -> dict[str, str]:
    """HAProxy's config, sockets and server-state files under ``directory`` instead of
    ``/tmp/haproxy-serve`` (Ray keeps each node's under its node id there): for a cluster whose
    node ids another on the machine may share (the fake provider's head is always ``ff..00000``:
    a second such cluster's HAProxy took over the first's admin socket, its reload failed, and
    Serve restarted the proxy, cutting every stream), or one with several HAProxies."""
    directory.mkdir(parents=True, exist_ok=True)
    return {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(directory / "haproxy.cfg"),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(directory / "admin.sock"),
            # HAProxy logs to it, and a log socket's path takes at most 97 characters (Ray adds
            # the node id's 56 to the folder): metrics.sock under a head_loss node's was 99.
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(directory / "m.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(directory),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(directory / "server-state")}


def start_service(config: dict[str, Any], base_url: str, log_path: Path,
                  ready_timeout_s: float = 300) -> subprocess.Popen:
    """``serve run`` of the config on a new local cluster, in its own process group, with
    HAProxy in front (unless the environment says otherwise) on stats, metrics and fallback
    ports of its own: HAProxy's fixed defaults (8404, 9101) were still held by another
    service's HAProxy on a busy machine, and this one could not start."""
    config_file = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    yaml.safe_dump(config, config_file)
    config_file.close()
    log = log_path.open("w")
    marker = secrets.token_hex(8)
    process = subprocess.Popen(
        [sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run",
         "--address", "local", config_file.name], cwd=ROOT, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
        # RAY_DEDUP_LOGS=0: the log keeps every replica's line (Ray folds lines that differ only
        # in numbers across processes, which hid most of the per-request lines bench_serve
        # matches once the Ingress ran as several replicas).
        env={**haproxy_env_of_its_own(), "RAY_DEDUP_LOGS": "0",
             **os.environ, "RAY_USAGE_STATS_ENABLED": "0", SERVICE_MARKER: marker})
    process.service_marker = marker  # type: ignore[attr-defined]
    started = time.monotonic()
    deadline = started + ready_timeout_s
    next_note = started + 60
    dashboard: str | None = None  # Serve's REST API, once the log names it
    try:
        while True:
            try:
                if httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200:
                    print(f"service ready after {time.monotonic() - started:.0f} s", flush=True)
                    return process
            except httpx.HTTPError:
                pass
            dashboard = dashboard or _dashboard_url(log_path)
            failed = _deploy_failure(dashboard) if dashboard else None
            if process.poll() is not None or failed or time.monotonic() > deadline:
                raise SystemExit(f"the service did not start in {time.monotonic() - started:.0f} s"
                                 f"{f' ({failed})' if failed else ''}; the end of {log_path}:\n"
                                 f"{_log_tail(log_path)}")
            if time.monotonic() > next_note:  # a slow start says so (and where it stands)
                print(f"waiting for the service: {time.monotonic() - started:.0f} s; the log "
                      f"ends:\n{_log_tail(log_path, 5)}", flush=True)
                next_note += 60
            time.sleep(1)
    except BaseException:
        stop_service(process)
        raise


def answers_ready(process: subprocess.Popen, base_url: str, timeout_s: float) -> bool:
    """Whether the service ``process`` runs answers ``GET /readyz`` with 200 within
    ``timeout_s`` (False at once if the process ends first)."""
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/readyz", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def _dashboard_url(log_path: Path) -> str | None:
    """The dashboard the service's own log names (its Ray's, not another one's), or None yet."""
    text = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
    found = DASHBOARD_URL.search(text)
    return found.group(1) if found else None


def _deploy_failure(dashboard: str) -> str | None:
    """``app DEPLOY_FAILED: why`` once Serve has given up on an application of the service (a
    replica whose constructor failed 3 times in a row), read from Serve's REST API on
    ``dashboard``; None while deploying or if it cannot be read. Serve keeps retrying such a
    replica, so without this the wait would run to its timeout."""
    try:
        reply = httpx.get(f"{dashboard}/api/serve/applications/", headers=_ray_auth(), timeout=5)
        applications = reply.json().get("applications") or {}
    except (httpx.HTTPError, ValueError):
        return None
    for name, app in applications.items():
        if app.get("status") == "DEPLOY_FAILED":
            # The app's message names the deployments; each failed one's holds its traceback,
            # whose end says what failed.
            whys = [str(app.get("message", ""))] + [
                f"{deployment}: {str(details.get('message', ''))[-1500:]}"
                for deployment, details in (app.get("deployments") or {}).items()
                if details.get("status") == "DEPLOY_FAILED"]
            return f"{name} DEPLOY_FAILED: {' '.join(whys)}"
    return None


def _ray_auth() -> dict[str, str]:
    """The header Ray's token authentication wants (on by default since Ray 2.5x): the token
    from ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH`` names, or ``~/.ray/auth_token``,
    where a new local cluster saves the one it generates. Empty when there is none."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not token and path.is_file():
        token = path.read_text(encoding="utf-8").strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


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
    # Ray's HAProxy outlives its cluster (it is re-parented, in a process group of its own) and
    # would keep its ports: end every process the service's environment marks.
    end_marked_processes(SERVICE_MARKER, getattr(process, "service_marker", ""), grace_s=5.0)


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


def replica_states(app_name: str = APP_NAME) -> dict[str, int]:
    """The Synthesizer's replicas (of the app ``app_name``) by state (RUNNING, STARTING,
    STOPPING, ...)."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    if app is None or DEPLOYMENT not in app.deployments:
        return {}
    states = app.deployments[DEPLOYMENT].replica_states
    return {str(getattr(state, "value", state)): count for state, count in states.items() if count}


def git_commit() -> str:
    """The commit a measurement ran at: ``BENCH_GIT_COMMIT`` (set where the tree is a copy
    without its history, as on the GPU machine), else the checkout's HEAD, else "unknown"."""
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
