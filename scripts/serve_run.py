#!/usr/bin/env python3
"""``serve run CONFIG`` on a local Ray whose Prometheus metrics port is fixed.

``serve run`` starts Ray itself with a random metrics export port; this starts it first with
``--metrics-port`` (Ray's ``metrics_export_port``), then hands over to ``serve run``, which
reuses the running Ray. The local Ray starts with Ray's HAProxy in front of the service
(``serve_app/ingress_env.py``; ``RAY_SERVE_ENABLE_HA_PROXY=0`` opts out). Prometheus scrapes
http://HOST:PORT/metrics: the service's ``ray_tts_*`` metrics and Ray Serve's ``ray_serve_*``
ones. With RAY_ADDRESS set (a cluster started by ``ray start --head --metrics-export-port=PORT``),
it joins that cluster instead.

Ctrl-C stops it in seconds: on its own local Ray a stopping Ingress stays reachable 2 s, not
Serve's 30 s, which ran out ``serve run``'s 30 s shutdown wait ("Controller failed to shut down
within 30.0s"; ``serve_app/ingress_env.py``). An environment value wins.

    scripts/serve_run.py serve_config.cpu.yaml --metrics-port 8080
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import ray
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve.scripts import cli

from serve_app.ingress_env import local_cluster_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a Serve config file (serve_config*.yaml)")
    parser.add_argument("--metrics-port", type=int, default=8080,
                        help="Prometheus metrics export port (default 8080)")
    args = parser.parse_args()
    if os.environ.get("RAY_ADDRESS"):
        ray.init(namespace=SERVE_NAMESPACE)
    else:
        # Read by Serve's controller and proxies when they start: set before Ray starts them.
        for name, value in local_cluster_env().items():
            os.environ.setdefault(name, value)
        ray.init(address="local", namespace=SERVE_NAMESPACE,
                 _metrics_export_port=args.metrics_port)
        print(f"serve_run: Prometheus metrics on http://127.0.0.1:{args.metrics_port}/metrics",
              file=sys.stderr)
    # Ctrl-C and SIGTERM both end `serve run` cleanly (it shuts Serve down on KeyboardInterrupt);
    # set after ray.init, which installs its own SIGTERM handler; SIGINT is re-armed because
    # shells start background jobs with it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    cli.main(["run", args.config], prog_name="serve")


if __name__ == "__main__":
    main()
