"""The coordinator's chat page at ``/`` (shell: one Starlette route; the page is static).

Rules:
- Self-contained: the HTML, its one stylesheet and its one script come from ``coordinator/static``
  and are inlined; nothing is loaded from anywhere else (no CDN, no font, no image).
- A strict Content-Security-Policy: the inline style and script run because their sha256 hashes are
  listed, nothing else does (no ``'unsafe-inline'``, no ``eval``); the page may only talk to its
  own origin (``connect-src 'self'``), cannot be framed, and has no form target.
- Text from the model is set as text (``textContent``), never parsed as markup.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

__all__ = ["ChatPage", "chat_page", "page_routes"]


class ChatPage:
    """The assembled page and the CSP that lets exactly its inline style and script run."""

    def __init__(self, html: str, css: str, js: str) -> None:
        if "</style" in css.lower() or "</script" in js.lower():
            raise ValueError("the inlined stylesheet or script must not close its own element")
        self.html = html.replace("{{STYLE}}", css).replace("{{SCRIPT}}", js)
        self.csp = "; ".join([
            "default-src 'none'",
            f"script-src {_hash(js)}",
            f"style-src {_hash(css)}",
            "connect-src 'self'",
            "img-src data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ])


def _hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


@functools.cache
def chat_page() -> ChatPage:
    """The page, read from the package once (on the first request)."""
    static = resources.files("coordinator") / "static"
    return ChatPage(*((static / name).read_text(encoding="utf-8") for name in ("chat.html", "chat.css", "chat.js")))


async def _page(_: Request) -> Response:
    page = chat_page()
    return HTMLResponse(page.html, headers={
        "content-security-policy": page.csp,
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
        "cache-control": "no-cache",
    })


def page_routes() -> list[Route]:
    return [Route("/", _page, methods=["GET"])]
