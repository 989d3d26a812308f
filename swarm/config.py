"""Configuration helpers (pure apart from reading the environment at the edge, when asked).

Rules (STYLE.md §6):
- Every service's config is a frozen msgspec Struct whose fields carry their limits as
  ``msgspec.Meta`` constraints; the CLI builds it once with ``build_config`` and passes it down
  by value. A bad value is a ``ConfigError`` naming the flag, never a traceback from deep inside.
- Nothing here reads the environment or the disk on import; ``env_token`` and ``data_dir_for``
  are called by the CLI, at the edge.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Final, TypeVar

import msgspec

from swarm.errors import ConfigError

__all__ = [
    "TOKEN_ENV",
    "HttpUrl",
    "Multiaddr",
    "NonNegFloat",
    "NonNegInt",
    "Port",
    "PosFloat",
    "PosInt",
    "build_config",
    "data_dir_for",
    "env_token",
    "parse_size",
    "physical_cores",
]

T = TypeVar("T")

TOKEN_ENV: Final = "MOE_SWARM_TOKEN"

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
_URL_PATTERN: Final = r"^https?://[^\s/]+(/[^\s]*)?$"
_MULTIADDR_PATTERN: Final = r"^/[^\s]+$"
HttpUrl = Annotated[str, msgspec.Meta(pattern=_URL_PATTERN, max_length=2048)]
Multiaddr = Annotated[str, msgspec.Meta(pattern=_MULTIADDR_PATTERN, max_length=1024)]

_PATH = re.compile(r"^\$\.?")


def build_config(cls: type[T], values: Mapping[str, Any], *, flags: Mapping[str, str] | None = None) -> T:
    """``cls`` from ``values`` (field name -> value), every constraint checked.

    ``flags`` maps field names to the flag a person typed (default ``--field-name``), so the error
    names what to fix: ``ConfigError: --port: Expected `int` <= 65535``.
    """
    try:
        return msgspec.convert(dict(values), cls)
    except msgspec.ValidationError as exc:
        text = str(exc)
        field, _, rest = text.rpartition(" - at `")
        where = rest.rstrip("`") if field else ""
        fields = [f for f in re.split(r"[.\[\]]", _PATH.sub("", where)) if f and not f.isdigit()]
        name = fields[-1] if fields else ""
        flag = (flags or {}).get(name, "--" + name.replace("_", "-")) if name else ""
        message = _plain(field, _value_at(values, where)) if field else text
        raise ConfigError(f"{flag}: {message}" if flag else f"bad configuration: {message}") from exc


def _value_at(values: Mapping[str, Any], where: str) -> Any:
    """The value at msgspec's error path (``$.origins[0]``) in ``values``, or None."""
    node: Any = values
    for key in re.findall(r"\.([^.\[]+)|\[(\d+)\]", where):
        try:
            node = node[key[0]] if key[0] else node[int(key[1])]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return node


def _plain(message: str, value: Any) -> str:
    """msgspec's message, said in words where it quotes one of our patterns."""
    if not isinstance(value, str) or "matching regex" not in message:
        return message
    if repr(_URL_PATTERN) in message:
        if "://" not in value:
            return f"{value!r} has no scheme: write http://{value} (or https://)"
        return f"{value!r} is not an http(s) URL such as http://127.0.0.1:8090"
    if repr(_MULTIADDR_PATTERN) in message:
        return f"{value!r} is not a multiaddr such as /ip4/0.0.0.0/tcp/4001"
    return message


def env_token(given: str | None) -> str | None:
    """The operator token: the flag, else ``MOE_SWARM_TOKEN``, else None (read at the edge only). An
    empty or blank one (``--token ""``, an unset variable expanded by a script) is no token: None, so a
    role that needs one refuses to start as it does without (an empty bearer would match anyone's)."""
    for candidate in (given, os.environ.get(TOKEN_ENV)):
        if candidate is not None:
            return candidate if candidate.strip() else None
    return None


def data_dir_for(role: str, given: str | None = None) -> str:
    """``--data-dir`` expanded, default ``~/.local/share/moe-swarm/<role>`` (DESIGN §11)."""
    return os.path.expanduser(given if given is not None else f"~/.local/share/moe-swarm/{role}")


def physical_cores(cpuinfo: str = "/proc/cpuinfo") -> int:
    """Physical CPU cores (not hyper-threads): the default for ``--threads``; ``os.cpu_count()`` if unknown."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except OSError:
        return os.cpu_count() or 1
    cores: set[tuple[str, str]] = set()
    phys = core = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            phys = value
        elif key == "core id":
            core = value
        elif not key and phys and core:
            cores.add((phys, core))
            phys = core = ""
    if phys and core:
        cores.add((phys, core))
    return len(cores) or os.cpu_count() or 1


def parse_size(text: str) -> int:
    """``512M``, ``2G``, ``1.5GiB``, ``4096B`` -> bytes; ``ValueError`` with a clear message otherwise (a
    bare number has no unit and is refused: ``swarm.flags.size_flag``)."""
    import argparse

    from swarm.flags import size_flag

    try:
        return size_flag(text)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
