"""Our loggers inside Serve replicas: into the replica's own log file, next to Serve's lines.

Serve gives only its ``ray.serve`` logger a handler; without this, ``serve_app`` records go to
the root logger, which drops INFO. ``SERVE_APP_LOG_LEVEL`` (default INFO) sets the level; at
DEBUG the request text is logged too (never the API keys, at any level).
"""

from __future__ import annotations

import logging
import os

LEVEL_ENV = "SERVE_APP_LOG_LEVEL"


def use_replica_log() -> None:
    """Send ``serve_app.*`` records to the handlers Serve set up for this replica."""
    ours = logging.getLogger("serve_app")
    serve_handlers = logging.getLogger("ray.serve").handlers
    if serve_handlers:
        ours.handlers = list(serve_handlers)
        ours.propagate = False
    ours.setLevel(os.environ.get(LEVEL_ENV, "INFO").upper())
