"""The chat playground: ``GET /`` and its static files under ``/web/``.

Plain HTML, CSS and one ES module shipped in the wheel (``core/server/web/``); nothing is fetched
from a CDN, so the page works offline. The page talks to the ordinary OpenAI routes
(``/v1/models``, streaming ``/v1/chat/completions``); its Stop button aborts the fetch, and the
server aborts the request when the connection closes. With ``--api-key`` the page and its files
are public (they hold no data) and the page asks for the key, which it keeps in sessionStorage.
"""

from __future__ import annotations

import json
from pathlib import Path

WEB_DIR = Path(__file__).resolve().parent / "web"
WEB_OPEN_PATHS = ("/web/",)
WEB_OPEN_EXACT = frozenset({"/"})
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
CONFIG_MARK = "<!--llmkit-config-->"
# The page runs only its own module and talks only to this server: an injected script or a
# framing page gets nothing (the config's inline JSON is a data block, which never executes).
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
NOSNIFF = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def web_router(state):
    from fastapi import APIRouter
    from fastapi.responses import Response

    from llmkit.core.server.errors import error_response

    router = APIRouter()
    files = {p.name: p for p in WEB_DIR.iterdir() if p.suffix in MEDIA_TYPES and p.name != "index.html"}
    # What the page cannot learn without the key: whether to ask for one.
    config = json.dumps({"auth": bool(state.options.api_keys or state.options.api_keys_file)})
    index = (
        (WEB_DIR / "index.html")
        .read_text()
        .replace(CONFIG_MARK, f'<script type="application/json" id="llmkit-config">{config}</script>')
    )

    @router.get("/", include_in_schema=False)
    async def page():
        headers = {**NOSNIFF, "Content-Security-Policy": CSP}
        return Response(index, media_type=MEDIA_TYPES[".html"], headers=headers)

    @router.get("/web/{name}", include_in_schema=False)
    async def static(name: str):
        path = files.get(name)  # only the shipped files: no path ever reaches the file system
        if path is None:
            return error_response(f"no such file: {name}", 404)
        return Response(path.read_bytes(), media_type=MEDIA_TYPES[path.suffix], headers=NOSNIFF)

    return router
