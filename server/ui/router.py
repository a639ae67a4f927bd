"""Routes of the block-map page.

- ``GET /ui`` and ``GET /ui/static/<asset>``: the page itself (plain HTML, CSS and one
  script, no CDN). They carry no data, so they load without the API key even under
  ``--protect-open-endpoints``: the page must load to ask for the key.
- ``GET /ui/api/config``: the startup totals and the KV shape the planner uses.
- ``GET /ui/api/stream``: server-sent events, one ``snapshot`` event per sample (at most a
  few a second, see hub.py). Both need the API key whenever ``--api-key`` is set.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from server.errors import APIError
from server.ui.hub import BlockMapHub

STATIC_DIR = Path(__file__).parent / "static"
# The only files served from STATIC_DIR (no path from the URL ever reaches the disk).
ASSETS = {
    "ui.js": "text/javascript; charset=utf-8",
    "ui.css": "text/css; charset=utf-8",
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Sent first on every stream: how long a browser waits before reconnecting.
SSE_PREAMBLE = b"retry: 2000\n\n"

router = APIRouter(include_in_schema=False)


def _hub(request: HTTPRequest) -> BlockMapHub:
    hub: BlockMapHub = request.app.state.ui_hub
    return hub


@router.get("/ui")
async def page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8")


@router.get("/ui/static/{name}")
async def asset(name: str) -> FileResponse:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise APIError(404, f"no UI asset named {name!r}", code="not_found")
    return FileResponse(STATIC_DIR / name, media_type=media_type)


@router.get("/ui/api/config")
async def config(request: HTTPRequest) -> JSONResponse:
    facts = request.app.state.ui_facts
    if facts is None:
        raise APIError(503, "this server has no KV plan to show", code="no_kv_plan")
    return JSONResponse(facts)


@router.get("/ui/api/stream")
async def stream(request: HTTPRequest) -> StreamingResponse:
    hub = _hub(request)

    async def events() -> AsyncIterator[bytes]:
        yield SSE_PREAMBLE
        async with hub.watch() as watcher:
            while (data := await watcher.next()) is not None:
                yield data

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
