"""The API docs pages (serve_app/front/api_docs.py) work offline: a tiny FastAPI app with the pages
mounted, served by uvicorn, loaded in headless Chromium (Debian's, driven by Playwright) that
may reach nothing but that server. Swagger UI must render the app's operations, ReDoc its
reference, and no request may go to another host (any such request fails the test, and is
aborted rather than sent)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from serve_app.front.api_docs import ASSET_FILES, ASSETS_URL, PAGE_POLICY, mount_offline_docs
from tests.browser import CHROMIUM_ARGS, chromium_path

pytestmark = pytest.mark.slow

RENDER_TIMEOUT_MS = 60_000  # Chromium on a small, busy machine


class Speech(BaseModel):
    input: str
    voice: str = "default"


def docs_app() -> FastAPI:
    app = FastAPI(title="Docs test", docs_url=None, redoc_url=None)

    @app.get("/v1/voices", summary="List the voices")
    async def voices() -> list[str]:
        return ["default"]

    @app.post("/v1/audio/speech", summary="Speak a text")
    async def speech(body: Speech) -> dict:
        return {"input": body.input}

    mount_offline_docs(app)
    return app


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(docs_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield "http://127.0.0.1:%d" % sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def blocked(console: list[str]) -> list[str]:
    """Loads the page's Content-Security-Policy refused, from the browser's console."""
    return [line for line in console if "Content Security Policy" in line]



def test_pages_and_assets_come_from_the_app(base_url: str) -> None:
    for page in ("/docs", "/redoc"):
        response = httpx.get(base_url + page, timeout=10)
        assert response.status_code == 200 and "<html>" in response.text
        assert "https://" not in response.text and "http://" not in response.text, page
        assert f"{ASSETS_URL}/" in response.text
        assert response.headers["content-security-policy"] == PAGE_POLICY
    for name in ASSET_FILES:
        assert httpx.get(f"{base_url}{ASSETS_URL}/{name}", timeout=10).status_code == 200
    assert httpx.get(base_url + "/docs/oauth2-redirect", timeout=10).status_code == 200
    paths = httpx.get(base_url + "/openapi.json", timeout=10).json()["paths"]
    assert set(paths) == {"/v1/voices", "/v1/audio/speech"}  # the pages stay out of the schema


def test_a_root_path_prefixes_every_address() -> None:
    client = TestClient(docs_app(), root_path="/tts")
    page = client.get("/docs").text
    assert "'/tts/openapi.json'" in page and f"/tts{ASSETS_URL}/swagger-ui-bundle.js" in page
    assert f"/tts{ASSETS_URL}/redoc.standalone.js" in client.get("/redoc").text


def test_an_app_with_its_own_docs_pages_is_refused() -> None:
    with pytest.raises(ValueError, match="docs_url=None"):
        mount_offline_docs(FastAPI())
    with pytest.raises(ValueError, match="OpenAPI"):
        mount_offline_docs(FastAPI(docs_url=None, redoc_url=None, openapi_url=None))


def test_docs_pages_render_offline_in_chromium(base_url: str, tmp_path: Path) -> None:
    if os.environ.get("CI"):
        from playwright import sync_api  # CI installs the test extra: never skip there
    else:
        sync_api = pytest.importorskip("playwright.sync_api")
    executable = chromium_path()
    own_host = urlsplit(base_url).netloc
    elsewhere: list[str] = []

    def only_the_app(route, request) -> None:
        parts = urlsplit(request.url)
        if parts.scheme in ("data", "blob") or parts.netloc == own_host:
            route.continue_()
        else:  # any other host: recorded, and never reached
            elsewhere.append(request.url)
            route.abort()

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=executable, headless=True,
            args=CHROMIUM_ARGS)
        try:
            browser.route("**/*", only_the_app)
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            console: list[str] = []
            page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))

            page.goto(f"{base_url}/docs")
            page.wait_for_selector(".opblock-summary-path", timeout=RENDER_TIMEOUT_MS)
            operations = {(block.query_selector(".opblock-summary-method").inner_text().strip(),
                           block.query_selector(".opblock-summary-path").inner_text().strip())
                          for block in page.query_selector_all(".opblock")}
            assert operations == {("GET", "/v1/voices"), ("POST", "/v1/audio/speech")}
            assert "Speak a text" in page.inner_text("#swagger-ui")
            assert blocked(console) == []  # Swagger UI does not even try another host
            console.clear()

            page.goto(f"{base_url}/redoc")
            page.wait_for_selector("text=Speak a text", timeout=RENDER_TIMEOUT_MS)
            assert "List the voices" in page.inner_text("body")
            # ReDoc's sidebar asks for Redocly's logo from its CDN; the page's policy stops the
            # browser before any request (the page then hides the image)
            assert all("cdn.redoc.ly/redoc/logo-mini.svg" in line for line in blocked(console))
        finally:
            browser.close()
    assert elsewhere == []
    assert errors == []
