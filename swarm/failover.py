"""Several replicas of one HTTP service behind one base URL (shell: an httpx transport).

``FailoverTransport(bases)`` sends every request addressed to ``bases[0]`` (same scheme, host and port)
to the replica that answered last, and fails over to the next ones in turn. A client keeps building its
URLs from the first base; requests to any other origin pass through untouched. Used by volunteers and
coordinators given several market URLs (``--market URL --market URL2``: market replicas on one database).

Rules:
- A request is sent to another replica only when the one tried surely did not act on it: the connection
  could not be opened (``ConnectError``, ``ConnectTimeout``), or it answered 503 (the market's
  ``store_error``: "the request changed nothing"; a replica cut off from its database says so). After an
  error once the request may have been sent (the replica died mid-request) the error is raised -- the
  caller's own retry decides, with a fresh signed counter or the same idempotent report -- and the next
  request goes to the next replica.
- The path below each base is the same on every replica (``bases`` differ in origin and prefix only);
  a request signature covers the method, the path and the body, never the host, so it is valid on every
  replica.
- The last replica's 503 is returned as it is; when none could be reached, the last connection error is
  raised.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx

__all__ = ["FailoverTransport", "client_transport"]


class FailoverTransport(httpx.AsyncBaseTransport):
    def __init__(self, bases: Sequence[str], inner: httpx.AsyncBaseTransport | None = None) -> None:
        if not bases:
            raise ValueError("FailoverTransport needs at least one base URL")
        self.bases = [httpx.URL(b) for b in bases]
        # each base as "scheme://host:port/prefix" without a trailing slash: a path below it is appended
        self._roots = [f"{u.scheme}://{u.netloc.decode('ascii')}{u.raw_path.decode('ascii').rstrip('/')}" for u in self.bases]
        self.inner = inner if inner is not None else httpx.AsyncHTTPTransport()
        self.current = 0  # the replica that answered last
        self.failovers = 0

    def _target(self, url: httpx.URL) -> str | None:
        """The path below ``bases[0]`` that ``url`` addresses (with its query), or None: another origin."""
        p = self.bases[0]
        prefix = p.raw_path.rstrip(b"/")
        if (url.scheme, url.host, url.port) != (p.scheme, p.host, p.port) or not url.raw_path.startswith(prefix):
            return None
        return url.raw_path[len(prefix):].decode("ascii")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        rest = self._target(request.url)
        if rest is None or len(self.bases) == 1:
            return await self.inner.handle_async_request(request)
        body = await request.aread()
        n = len(self.bases)
        last: Exception | None = None
        for k in range(n):
            i = (self.current + k) % n
            url = httpx.URL(self._roots[i] + rest)
            headers = request.headers.copy()
            headers["host"] = url.netloc.decode("ascii")
            req = httpx.Request(request.method, url, headers=headers, content=body, extensions=request.extensions)
            try:
                resp = await self.inner.handle_async_request(req)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never sent: the next replica
                last = exc
                self.failovers += 1
                continue
            except httpx.TransportError:
                self.current = (i + 1) % n  # maybe acted on: not resent here; the next request goes elsewhere
                self.failovers += 1
                raise
            if resp.status_code == 503 and k < n - 1:  # it changed nothing: the next replica
                await resp.aclose()
                self.failovers += 1
                continue
            self.current = i
            return resp
        raise last if last is not None else httpx.ConnectError("no market replica could be reached", request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def client_transport(primary: str, others: Sequence[str]) -> httpx.AsyncBaseTransport | None:
    """A ``FailoverTransport`` over ``primary`` and ``others``, or None (httpx's own) without others."""
    return FailoverTransport([primary, *others]) if others else None
