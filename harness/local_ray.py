"""What a Ray started on this machine for one run needs, beside the others on it: ports no other
process is handed (:func:`free_ports`), and its processes, found by a marker in their
environment and ended together (:func:`end_marked_processes`), never by ``ray stop``, which
would end every Ray on the machine.

The app served for a benchmark or a test (``harness/service.py``), the multi-node clusters of
``fleet/`` and the tests' own services all start their processes this way.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from contextlib import ExitStack
from pathlib import Path


RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default worker range
QUIET_PORTS_FROM = 20000  # up to the OS's ephemeral range: ports no process is handed unasked


def ephemeral_port_range() -> range:
    """The ports the OS hands out for ``bind(0)`` and outgoing connections (Linux's file;
    its default elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_ports(count: int) -> list[int]:
    """Distinct ports free now, from those no process is handed unasked: above Ray's worker
    range and below the OS's ephemeral range. An ephemeral one is taken back within seconds by
    Ray's own processes, which bind ephemeral ports and connect out from them (a Serve proxy
    once failed to bind its HTTP port that way). Where that gap is too small, ephemeral ports
    outside Ray's worker range."""
    quiet = range(QUIET_PORTS_FROM, ephemeral_port_range().start)
    with ExitStack() as stack:
        ports: list[int] = []
        tries = 0
        while len(ports) < count:
            probe = stack.enter_context(socket.socket())
            tries += 1
            if len(quiet) >= 1000 and tries <= 1000:
                try:
                    probe.bind(("127.0.0.1", random.choice(quiet)))
                except OSError:
                    continue
            else:
                probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
            if port not in RAY_WORKER_PORTS and port not in ports:
                ports.append(port)
        return ports


def pids_with_env(name: str, value: str) -> list[int]:
    """Processes whose environment has ``name=value``: the ones a marked launcher started."""
    needle = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def end_marked_processes(name: str, value: str, grace_s: float = 10.0) -> list[int]:
    """SIGTERM, then after ``grace_s`` SIGKILL, every process carrying the marker; returns them."""
    pids = pids_with_env(name, value)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        alive = pids_with_env(name, value)
        if not alive:
            break
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids_with_env(name, value) and time.monotonic() < deadline:
            time.sleep(0.2)
    return pids
