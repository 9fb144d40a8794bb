"""The engine benchmark's mixed mode (bench/engine/run.py --mixed): read and chat streams arrive
together in one level, on the real engine (tiny checkpoint, CPU), and each kind is counted on
its own. Whether they keep real time on this machine is not asserted (a measurement, not a
check): what is asserted is that both kinds ran in the level and the headline follows the
levels that held."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.serving.conftest import ROOT


@pytest.mark.timeout(900)
def test_a_mixed_level_runs_read_and_chat_streams_together_and_counts_each(
        tiny_checkpoint, tmp_path) -> None:
    out = tmp_path / "mixed.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.engine.run", "--device", "cpu", "--dtype", "float32",
         "--checkpoint", str(tiny_checkpoint), "--modes", "--mixed", "2:1", "3:1",
         "--audio-seconds", "1", "--chat-tokens", "6", "--baseline", "none", "--no-graphs",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    levels = result["mixed"]
    assert [(level["read"], level["chat"]) for level in levels] == [(2, 1), (3, 1)]
    for level in levels:
        # Poisson arrivals of each kind: twice its count, at least four
        assert level["by_kind"]["read"]["streams"] == max(2 * level["read"], 4)
        assert level["by_kind"]["chat"]["streams"] == max(2 * level["chat"], 4)
        assert level["requests"] == sum(kind["streams"] for kind in level["by_kind"].values())
        # each late stream says when it arrived and first ran dry, within the level
        for late in level["late_streams"]:
            assert late["kind"] in ("read", "chat")
            assert 0 <= late["submitted_s"] < late["dry_s"] <= level["wall_s"] + 1
        assert level["ok"] == all(kind["realtime_share"] >= 0.99 and kind["ttfb_ms_p99"] <= 500
                                  for kind in level["by_kind"].values())
    held = [level for level in levels if level["ok"]]
    expected = ({"read": held[-1]["read"], "chat": held[-1]["chat"]} if held
                else {"read": 0, "chat": 0})
    assert result["max_realtime_streams"]["mixed"] == expected
