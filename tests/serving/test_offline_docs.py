"""The API docs pages of the real app (HAProxy in front), with their assets served by the app
itself (serve_app/front/api_docs.py; tests/test_api_docs.py renders them offline in Chromium): no API
key needed, nothing loaded from a CDN."""

from __future__ import annotations

import httpx
import pytest

from serve_app.front.api_docs import ASSET_FILES, ASSETS_URL, PAGE_POLICY
from tests.serving.conftest import Server

pytestmark = pytest.mark.slow

CDNS = ("cdn.jsdelivr.net", "fonts.googleapis.com", "unpkg.com")


@pytest.mark.parametrize(("page", "asset"), [("/docs", "swagger-ui-bundle.js"),
                                             ("/redoc", "redoc.standalone.js")])
def test_docs_pages_and_their_assets_come_from_the_app_without_a_key(
        server: Server, page: str, asset: str) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as anonymous:
        response = anonymous.get(page)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/html")
        assert response.headers["content-security-policy"] == PAGE_POLICY
        assert f"{ASSETS_URL}/{asset}" in response.text
        assert "/openapi.json" in response.text
        assert not any(cdn in response.text for cdn in CDNS), response.text
        script = anonymous.get(f"{ASSETS_URL}/{asset}")
        assert script.status_code == 200
        assert "javascript" in script.headers["content-type"]
        assert len(script.content) > 100_000
        schema = anonymous.get("/openapi.json")
        assert schema.status_code == 200
        assert "/v1/audio/speech" in schema.json()["paths"]


def test_every_docs_asset_is_served_and_a_missing_one_is_a_json_404(server: Server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as anonymous:
        for name in ASSET_FILES:
            assert anonymous.get(f"{ASSETS_URL}/{name}").status_code == 200, name
        missing = anonymous.get(f"{ASSETS_URL}/no-such-file.js")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"
