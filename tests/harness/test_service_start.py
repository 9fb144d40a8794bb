"""harness/service.py's start of `serve run`: a service whose synthesizer can never start (a
model path that does not exist) is reported as failed once Serve gives up on it, with Serve's
reason, instead of being waited on until the timeout (Serve itself keeps retrying it)."""

from __future__ import annotations

import pytest
import yaml

from harness.local_ray import free_ports
from harness.service import ROOT, start_service

pytestmark = pytest.mark.slow


def test_a_synthesizer_that_cannot_start_fails_the_start_with_serves_reason(tmp_path,
                                                                           monkeypatch):
    # Serve gives up on the deployment after one failed start of its replica, not three (its
    # controller, started by `serve run`, inherits this): the same verdict, sooner.
    monkeypatch.setenv("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT", "1")
    config = yaml.safe_load((ROOT / "serve_config.cpu.yaml").read_text(encoding="utf-8"))
    [port] = free_ports(1)
    config["http_options"]["port"] = port
    [app] = config["applications"]
    app["args"]["engine_options"]["model_path"] = str(tmp_path / "no-such-voice.onnx")
    log = tmp_path / "serve.log"
    with pytest.raises(SystemExit) as failed:
        # Far longer than the failure takes: the start must end on Serve's verdict, not on this.
        start_service(config, f"http://127.0.0.1:{port}", log, ready_timeout_s=1800)
    serve_says = str(failed.value).split("; the end of")[0]  # before the log's tail
    assert "DEPLOY_FAILED" in serve_says
    assert "no-such-voice.onnx" in serve_says  # the replica's own error, through Serve
