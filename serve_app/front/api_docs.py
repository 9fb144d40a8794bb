"""The API's documentation pages, Swagger UI at ``/docs`` and ReDoc at ``/redoc``, with every
asset served by the app itself.

FastAPI's own pages load Swagger UI and ReDoc from a CDN (and ReDoc its fonts from Google), so
on a cluster without internet they stay blank. Here the JavaScript, CSS and favicon come from
the ``fastapi-offline`` package (MIT; it ships the ``swagger-ui-dist`` 5 and ``redoc`` 2
standalone bundles, Apache-2.0 and MIT), mounted under :data:`ASSETS_URL`; the pages are
FastAPI's own HTML pointed at them, without Google Fonts and without Swagger UI's online
validator badge. ReDoc's sidebar still shows Redocly's logo from its CDN: the pages carry a
Content-Security-Policy that lets them load nothing from another host (:data:`PAGE_POLICY`), so
the browser never asks for it. Create the app with ``docs_url=None, redoc_url=None`` and call
:func:`mount_offline_docs`.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
ASSETS_URL = "/docs-assets"
ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"
ASSET_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")
# The pages' own inline script and styles, the app's assets and schema, ReDoc's search worker
# (a blob) and inline images; nothing from elsewhere.
PAGE_POLICY = ("default-src 'self'; script-src 'self' 'unsafe-inline'; "
               "style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
               "font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
               "base-uri 'self'; form-action 'self'; frame-ancestors 'self'")


def mount_offline_docs(app: FastAPI, docs_url: str = DOCS_URL, redoc_url: str = REDOC_URL,
                       assets_url: str = ASSETS_URL) -> None:
    """Serve Swagger UI at ``docs_url`` and ReDoc at ``redoc_url`` (and Swagger UI's OAuth2
    redirect page) from ``app``, their assets under ``assets_url``; ``app`` must have been
    created with ``docs_url=None, redoc_url=None`` and keep its OpenAPI schema."""
    if app.docs_url is not None or app.redoc_url is not None:
        raise ValueError("create the app with docs_url=None, redoc_url=None: its own docs pages "
                         "load their assets from a CDN")
    if app.openapi_url is None:
        raise ValueError("the docs pages need the app's OpenAPI schema (openapi_url is None)")
    missing = [name for name in ASSET_FILES if not (ASSETS_DIR / name).is_file()]
    if missing:
        raise RuntimeError(f"fastapi-offline lacks {', '.join(missing)} in {ASSETS_DIR}")
    openapi_url = app.openapi_url
    oauth2_redirect_url = app.swagger_ui_oauth2_redirect_url
    app.mount(assets_url, StaticFiles(directory=ASSETS_DIR), name="docs-assets")

    def prefix(request: Request) -> str:
        """The app's root path (behind a proxy or a route prefix), as FastAPI's pages use."""
        return request.scope.get("root_path", "").rstrip("/")

    @app.get(docs_url, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = prefix(request)
        return local_only(get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - Swagger UI",
            oauth2_redirect_url=root + oauth2_redirect_url if oauth2_redirect_url else None,
            swagger_js_url=f"{root}{assets_url}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{assets_url}/swagger-ui.css",
            swagger_favicon_url=f"{root}{assets_url}/favicon.png",
            init_oauth=app.swagger_ui_init_oauth,
            # no badge that sends the schema's address to validator.swagger.io
            swagger_ui_parameters={"validatorUrl": None, **(app.swagger_ui_parameters or {})},
        ))

    if oauth2_redirect_url:
        @app.get(oauth2_redirect_url, include_in_schema=False)
        async def swagger_ui_oauth2_redirect() -> HTMLResponse:
            return get_swagger_ui_oauth2_redirect_html()

    @app.get(redoc_url, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = prefix(request)
        return local_only(get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{assets_url}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{assets_url}/favicon.png",
            with_google_fonts=False,
        ))


def local_only(page: HTMLResponse) -> HTMLResponse:
    """The page, allowed to load nothing from another host (:data:`PAGE_POLICY`)."""
    page.headers["Content-Security-Policy"] = PAGE_POLICY
    return page
