"""Checks a command makes before it starts its service (shell: sockets, one HTTP round trip each).

Rules:
- Each failure is one ``ConfigError`` that names the flag to change and says what to do (one line,
  exit code 2 in ``swarm.cli``), found in milliseconds -- not after a model has loaded, and not as a
  traceback from deep inside a server.
- A port is checked by binding it the way our servers do (``SO_REUSEADDR``: a port whose last
  connections linger in TIME_WAIT is free) and closing it at once; port 0 needs no check. This is a
  check, not a reservation: a port taken between the check and the bind still fails in one line.
- A market is checked once: ``GET /health`` must answer as a market does, and with ``token`` set
  (the coordinator) an operator-only read (``GET /api/expert-dispatch-map``) must not be refused.
  A market that cannot be reached at start is an error to fix, not one to wait out; an outage
  after start is retried (the volunteer daemon, ``coordinator.dispatch.market_link``).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable, Sequence
from typing import Any, Final

from swarm.errors import ConfigError
from swarm.protocol.http import error_code

__all__ = ["check_listen_addrs", "check_market", "check_port_free", "check_reachable", "token_refusal"]

_TIMEOUT_S: Final = 5.0


def check_port_free(host: str, port: int, flag: str = "--port", *, host_flag: str = "--host",
                    shown: str | None = None) -> None:
    """``ConfigError`` unless ``host:port`` can be bound now; ``shown`` is what the person typed
    (default ``--port PORT``), ``host_flag`` the flag that chose ``host``."""
    if port == 0:
        return
    shown = shown or f"{flag} {port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"{host_flag} {host}: cannot resolve it ({exc.strerror})", code="bad_host") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"{shown}: {host}:{port} is already in use (another process listens there); "
                                  f"stop it, or choose another port", code="address_in_use") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(f"{host_flag} {host}: not an address of this machine", code="bad_host") from None
            if exc.errno == errno.EACCES:
                raise ConfigError(f"{shown}: permission denied (ports below 1024 need privileges); "
                                  "choose another port", code="address_denied") from None
            raise ConfigError(f"{shown}: cannot bind {host}:{port} ({exc.strerror})", code="address_error") from None


def check_listen_addrs(addrs: Iterable[str], flag: str) -> None:
    """``check_port_free`` for each ``/ip4|ip6/HOST/tcp/PORT[/...]`` multiaddr in ``addrs``."""
    for addr in addrs:
        parts = addr.split("/")
        if len(parts) >= 5 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp" and parts[4].isdigit():
            check_port_free(parts[2], int(parts[4]), flag, host_flag=f"{flag} {addr}:", shown=f"{flag} {addr}")


def token_refusal(status: int, body: bytes, *, token_given: bool) -> str:
    """What to tell a person when the market answered an operator request with 401/403 (to follow
    "the market ..."): what it answered, and whether a token was sent at all."""
    code = error_code(body) or "no error code"
    if token_given:
        return f"refused the operator token (HTTP {status} {code})"
    return f"requires an operator token (HTTP {status} {code}): give --token or set MOE_SWARM_TOKEN"


def _get(url: str, flag: str, what: str, **kw: Any) -> Any:
    import httpx

    try:
        return httpx.get(url, timeout=_TIMEOUT_S, **kw)
    except httpx.TimeoutException:
        reason = f"no answer within {_TIMEOUT_S:.0f} s"
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
    base = url.split("/health")[0].split("/api/")[0]
    raise ConfigError(f"{flag} {base}: cannot reach the {what} ({reason}); is it running, and is the URL right?",
                      code=f"{what}_unreachable")


def check_reachable(url: str, flag: str, what: str) -> dict[str, Any]:
    """``GET url/health`` answers 200 with a JSON object (returned), or a ``ConfigError`` naming ``flag``."""
    base = url.rstrip("/")
    r = _get(f"{base}/health", flag, what)
    try:
        body = r.json() if r.status_code == 200 else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ConfigError(f"{flag} {url}: answered HTTP {r.status_code} on /health, not as a moe-swarm {what} does",
                          code=f"not_a_{what}")
    return body


def check_any_market(urls: Sequence[str], flag: str = "--market", *, token: str | None = None,
                     operator: bool = False) -> None:
    """Some replica of the market (``urls``: ``--market`` given several times) answers: ``check_market`` of
    each in turn; the last one's ``ConfigError`` when none does."""
    for i, url in enumerate(urls):
        try:
            check_market(url, flag, token=token, operator=operator)
            return
        except ConfigError:
            if i == len(urls) - 1:
                raise


def check_market(url: str, flag: str = "--market", *, token: str | None = None, operator: bool = False) -> None:
    """The market at ``url`` answers (and, for an ``operator``, accepts ``token``), or a ``ConfigError``."""
    health = check_reachable(url, flag, "market")
    if "volunteers" not in health:
        other = f" (its /health names the model {health['model']!r}: a coordinator?)" if "model" in health else ""
        raise ConfigError(f"{flag} {url}: not a moe-swarm market{other}", code="not_a_market")
    if not operator:
        return
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # an operator-only read that changes nothing: refused (401/403) or answered (404: no such model)
    r = _get(f"{url.rstrip('/')}/api/expert-dispatch-map", flag, "market", params={"model": "-"}, headers=headers)
    if r.status_code in (401, 403):
        raise ConfigError(f"--token: the market at {url} {token_refusal(r.status_code, r.content, token_given=bool(token))}",
                          code="token_refused")
