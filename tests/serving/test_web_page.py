"""The web page at ``/`` in headless Chromium (Debian's, driven by Playwright): it speaks.

Chromium has no sound card here; WebAudio still runs its clock, so "audio played" means the
page's AudioContext time and its played-seconds counter advanced past the scheduled audio.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.browser import CHROMIUM_ARGS, chromium_path
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
TEXT = "Hello from the browser. This sentence streams while it plays."
LONG_TEXT = " ".join(f"Sentence {n} of a text that is stopped long before its end."
                     for n in range(1, 30))


def aborted(server: Server) -> int:
    """Engine streams aborted so far; from a thread of its own, since Playwright's sync API
    runs an event loop in this one and Ray's blocking calls refuse to run inside a loop."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(server.synthesizer_stats).result()["engine"]["aborted"]


def test_root_serves_a_self_contained_page(server: Server) -> None:
    response = httpx.get(f"{server.base_url}/", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "/v1/speech/stream" in page and "AudioContext" in page
    # No CDN or other outside resource: everything ships inside the package.
    assert "https://" not in page and "http://" not in page


def test_page_speaks_a_sentence_while_it_streams(server: Server,
                                                 tmp_path: Path) -> None:
    if os.environ.get("CI"):
        from playwright import sync_api  # CI installs the test extra: never skip there
    else:
        sync_api = pytest.importorskip("playwright.sync_api")
    executable = chromium_path()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as playwright:
        # A fresh profile folder per run (Playwright passes it as --user-data-dir).
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=executable, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 860, "height": 720})
        try:
            page = browser.new_page()
            page.goto(f"{server.base_url}/")
            page.fill("#key", server.api_key)
            page.dispatch_event("#key", "change")
            # The voice list comes from /v1/voices once the key is accepted.
            page.wait_for_function("document.querySelector('#voice').options.length > 1")
            page.select_option("#format", "pcm")
            page.fill("#text", TEXT)
            page.click("#speak")
            page.wait_for_function("window.ttsState.ttfbMs !== null", timeout=60_000)
            # Playback starts while the body still streams; wait for it to finish playing.
            page.wait_for_function(
                "window.ttsState.done && window.ttsState.audioS > 0 && "
                "window.ttsState.playedS >= window.ttsState.audioS - 0.05", timeout=90_000)
            state = page.evaluate("window.ttsState")
            page.screenshot(path=str(ARTIFACTS / "web-page.png"))
            ttfb_text = page.inner_text("#ttfb")
            rtf_text = page.inner_text("#rtf")
            # mp3 streams through MediaSource into the <audio> element instead.
            page.select_option("#format", "mp3")
            page.fill("#text", "Now in mp3.")
            page.click("#speak")
            page.wait_for_function(
                "window.ttsState.done && window.ttsState.format === 'mp3' && "
                "window.ttsState.audioS > 0 && "
                "window.ttsState.playedS >= window.ttsState.audioS - 0.1", timeout=90_000)
            mp3_state = page.evaluate("window.ttsState")
            # Stop mid-stream: the page aborts the request and the server frees the engine slot.
            aborted_before = aborted(server)
            page.select_option("#format", "pcm")
            page.fill("#text", LONG_TEXT)
            page.click("#speak")
            page.wait_for_function("window.ttsState.ttfbMs !== null", timeout=60_000)
            page.click("#stop")
            page.wait_for_function("window.ttsState.done", timeout=30_000)
            stopped = page.evaluate("[window.ttsState.error, document.querySelector('#status')"
                                    ".textContent]")
            deadline = time.monotonic() + 30
            while aborted(server) == aborted_before:
                assert time.monotonic() < deadline, "stopping the page never aborted the stream"
                time.sleep(0.2)
        finally:
            browser.close()
    assert state["error"] is None
    assert state["audioS"] > 2.0
    assert state["contextTime"] >= state["audioS"]
    assert state["playedS"] > 2.0
    assert 0 < state["ttfbMs"] < 30_000 and 0 < state["rtf"] < 5
    assert ttfb_text.endswith(" ms") and int(ttfb_text.split()[0]) > 0
    assert float(rtf_text) > 0
    assert mp3_state["error"] is None and mp3_state["ttfbMs"] > 0 and mp3_state["audioS"] > 0.3
    assert stopped == [None, "Stopped."]
