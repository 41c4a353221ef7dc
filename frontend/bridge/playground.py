"""`GET /`: the streaming playground, one static HTML page (no build step)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from aiohttp import web

PAGE = Path(__file__).resolve().parent.parent / "static" / "playground.html"


@cache
def _page() -> bytes:
    return PAGE.read_bytes()


async def handle_playground(request: web.Request) -> web.Response:
    return web.Response(body=_page(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache"})
