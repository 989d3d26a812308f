"""Hugging Face references to a GGUF model, and which file of a repository they mean (pure).

A ``--model`` value is a local path unless it is one of:
- ``hf:ORG/REPO/PATH.gguf``: that file of the repository (``PATH`` may hold folders);
- ``hf:ORG/REPO[:QUANT]`` or ``ORG/REPO[:QUANT]``: the file llama.cpp's ``-hf ORG/REPO[:QUANT]`` picks.

Rules (``is_hub_ref``, ``parse_hub_ref``, ``choose_file``):
- ``hf:`` always means the hub. Without it, a value that names an existing file is that file (the
  caller decides, it has the file system), and a value shaped ``ORG/REPO`` or ``ORG/REPO:QUANT`` (one
  slash, no ``.gguf`` ending, names of letters, digits, ``-``, ``_``, ``.``) means the hub.
- The file for a quant, as llama.cpp's ``find_best_model`` (common/download.cpp): among the
  repository's ``.gguf`` files that are models (not ``mmproj``, ``imatrix``, ``mtp-``, ``eagle3-``,
  ``dflash-``, ``dspark-`` files) the first, in path order, whose path matches ``QUANT`` followed by
  ``.`` or ``-`` (case-insensitive); a split model counts by its first part only. Without a quant the
  tags are ``Q4_K_M`` then ``Q8_0``, then any model file. A quant nobody matches is an error listing
  the GGUF files there are; so is an explicit path that is not in the repository (compared
  case-insensitively, as llama.cpp does).
- A model split into parts (``NAME-00001-of-00003.gguf``) is refused with what to do instead: this
  loader reads one file (merge the parts with llama.cpp's ``llama-gguf-split --merge``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_TAGS", "HubRef", "HubRefError", "choose_file", "is_hub_ref", "parse_hub_ref", "split_info"]

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO = re.compile(rf"({_NAME})/({_NAME})")
_BARE = re.compile(rf"{_NAME}/{_NAME}(:[A-Za-z0-9._-]+)?")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})\.gguf$", re.IGNORECASE)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


class HubRefError(ValueError):
    """A reference that names nothing usable (the message says why, for a person)."""


@dataclass(frozen=True)
class HubRef:
    repo: str  # ORG/REPO
    path: str | None = None  # a file of the repository, or None: chosen by ``quant``
    quant: str | None = None  # e.g. Q4_K_M; None: the defaults

    def __str__(self) -> str:
        if self.path is not None:
            return f"hf:{self.repo}/{self.path}"
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


def is_hub_ref(value: str) -> bool:
    """Does ``value`` mean the hub (see the rules; an existing file of that name is the caller's to prefer)?"""
    if value.startswith("hf:"):
        return True
    return _BARE.fullmatch(value) is not None and not value.lower().endswith(".gguf")


def parse_hub_ref(value: str) -> HubRef:
    body = value[3:] if value.startswith("hf:") else value
    repo_part, _, quant = body.partition(":")
    parts = repo_part.split("/")
    if len(parts) < 2 or _REPO.fullmatch("/".join(parts[:2])) is None:
        raise HubRefError(f"{value!r} is not a Hugging Face reference: use hf:ORG/REPO/FILE.gguf or ORG/REPO[:QUANT]")
    repo = "/".join(parts[:2])
    if len(parts) > 2:
        path = "/".join(parts[2:])
        if quant:
            raise HubRefError(f"{value!r}: give a file or a quant, not both")
        if any(p in ("", ".", "..") for p in parts[2:]) or not path.lower().endswith(".gguf"):
            raise HubRefError(f"{value!r}: the file must be a .gguf path inside the repository")
        return HubRef(repo, path=path)
    if ":" in body and not re.fullmatch(r"[A-Za-z0-9._-]+", quant):
        raise HubRefError(f"{value!r}: the quant after ':' must be a name such as Q4_K_M")
    return HubRef(repo, quant=quant or None)


@dataclass(frozen=True)
class SplitInfo:
    prefix: str
    index: int
    count: int


def split_info(path: str) -> SplitInfo | None:
    """``NAME-00002-of-00005.gguf`` -> (NAME, 2, 5); None for a file in one piece."""
    m = _SPLIT.match(path)
    return SplitInfo(m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def _is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.lower().endswith(".gguf") and not any(k in name for k in _NOT_MODELS)


def _first_part(path: str) -> bool:
    s = split_info(path)
    return s is None or s.index == 1


def choose_file(ref: HubRef, files: Sequence[str]) -> str:
    """The file of ``ref`` among the repository's ``files`` (see the rules)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    listing = ", ".join(ggufs) or "none"
    if ref.path is not None:
        chosen = next((f for f in sorted(files) if f.lower() == ref.path.lower()), None)
        if chosen is None:
            raise HubRefError(f"{ref.repo} has no file {ref.path!r}; its GGUF files: {listing}")
    else:
        models = [f for f in ggufs if _is_model(f) and _first_part(f)]
        chosen = None
        for tag in (ref.quant,) if ref.quant else DEFAULT_TAGS:
            pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
            chosen = next((f for f in models if pattern.search(f)), None)
            if chosen is not None:
                break
        if chosen is None and ref.quant is None and models:
            chosen = models[0]
        if chosen is None:
            what = f"no GGUF file for quant {ref.quant}" if ref.quant else "no GGUF model file"
            raise HubRefError(f"{ref.repo} has {what}; its GGUF files: {listing}")
    s = split_info(chosen)
    if s is not None and s.count > 1:
        raise HubRefError(f"{ref.repo}: {chosen} is part 1 of {s.count}; moe-swarm reads a model in one file: "
                          f"merge the parts with llama.cpp's `llama-gguf-split --merge` and give the merged path")
    return chosen
