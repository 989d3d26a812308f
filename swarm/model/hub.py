"""A GGUF model from the Hugging Face hub (shell: huggingface_hub, files).

``resolve_hub_model("ORG/REPO:Q4_K_M")`` asks the hub (``HF_ENDPOINT``, ``HF_TOKEN`` and the cache
folder are huggingface_hub's own settings, or given) which files the repository holds, picks one
(``swarm.core.hubref``), downloads it into huggingface_hub's cache and returns where it is.

Rules:
- One revision: the commit the repository's listing names; the file is downloaded at that commit.
- Downloads are huggingface_hub's (``hf_hub_download``): into its cache (``blobs/<sha256>`` with a
  ``snapshots/<commit>/<file>`` link, so the path's file name is the repository's and the model id
  keeps its base name), continued with ``Range`` where a transfer broke, never leaving a partial
  file in the cache. The bytes are counted on ``progress`` (``swarm.progress``: the caller draws them).
- Verified: the file's sha256 must be the one the hub's LFS metadata gives (``HubFile.check``; the
  coordinator hashes the file when it loads it anyway, so the check costs no second read). A file
  that fails is deleted from the cache (blob and link) and refused with one line: running again
  downloads it anew.
- A truncated transfer (fewer bytes than the hub's size) is refused with one line saying so.
- Offline (the hub unreachable) a repository already in the cache is listed from its snapshot, so a
  model downloaded once starts without the network (its sha256 is then its blob's name).
- Every failure is a ``ConfigError`` naming the reference and what to do: no traceback for a typo,
  a missing quant, a private repository without a token, or an unreachable hub.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarm.core.hubref import HubRef, HubRefError, choose_file, is_hub_ref, parse_hub_ref
from swarm.errors import ConfigError
from swarm.progress import Transfers

__all__ = ["HubFile", "is_hub_model", "resolve_hub_model"]

log = logging.getLogger(__name__)


def is_hub_model(value: str) -> bool:
    """Does ``--model value`` mean the hub? (An existing file of that name is a file.)"""
    return is_hub_ref(value) and not (not value.startswith("hf:") and os.path.exists(value))


@dataclass(frozen=True)
class HubFile:
    """A model file downloaded from the hub: where it is and what it must be."""

    ref: HubRef
    repo: str
    filename: str  # in the repository
    commit: str
    path: Path  # the cache's snapshot link (named as in the repository)
    size: int | None
    sha256: str | None  # from the hub's LFS metadata (None: not an LFS file, nothing to check against)

    @property
    def name(self) -> str:
        return f"{self.repo}/{self.filename}"

    def check(self, sha256: str | None = None) -> None:
        """Raise (and delete the file from the cache) unless its sha256 is the hub's; ``sha256``: the
        file's own when the caller has it, else it is computed here."""
        if self.sha256 is None:
            return
        got = sha256 if sha256 is not None else _sha256_of(self.path)
        if got != self.sha256:
            _evict(self.path)
            raise ConfigError(f"--model {self.ref}: {self.name} has sha256 {got[:16]}..., the hub says "
                              f"{self.sha256[:16]}...: a corrupt download, deleted from the cache; run again to "
                              "download it anew", code="hub_download_corrupt")


def _sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _evict(link: Path) -> None:
    blob = link.resolve()
    for p in (link, blob):
        try:
            p.unlink()
        except OSError as exc:
            log.warning("could not delete %s: %s", p, exc)


def _bar_class(transfers: Transfers | None, name: str) -> type | None:
    """huggingface_hub's ``tqdm_class`` seam, counting on ``transfers`` (no tqdm: it calls the class
    with tqdm's keywords, enters it and calls ``update``)."""
    if transfers is None:
        return None
    counter: Transfers = transfers

    class _Count:
        def __init__(self, *, total: int | None = None, initial: int = 0, **_: Any) -> None:
            self.t = counter.start(name, total, initial)

        def update(self, n: int | float = 1) -> None:
            self.t.advance(int(n))

        def close(self) -> None:
            counter.finish(self.t)

        def __enter__(self) -> _Count:
            return self

        def __exit__(self, kind: object, *_: object) -> None:
            counter.finish(self.t, ok=kind is None)

    return _Count


def resolve_hub_model(value: str, *, progress: Transfers | None = None, cache_dir: Path | None = None,
                      endpoint: str | None = None, token: str | None = None) -> HubFile:
    """Download (or find in the cache) the GGUF file ``value`` names (see the module rules)."""
    try:
        ref = parse_hub_ref(value)
    except HubRefError as exc:
        raise ConfigError(f"--model: {exc}", code="bad_model_ref") from exc
    import huggingface_hub as hf
    from huggingface_hub import constants
    from huggingface_hub import errors as hf_errors

    where = endpoint or constants.ENDPOINT

    def fail(what: str, code: str) -> ConfigError:
        return ConfigError(f"--model {ref}: {what}", code=code)

    cache = str(cache_dir) if cache_dir is not None else None
    network: tuple[type[BaseException], ...] = (OSError, *_transport_errors())  # the hub unreachable (HfHubHTTPError, an answer, is caught first)
    listing: tuple[str, list[tuple[str, int | None, str | None]]] | None = None
    try:
        info = hf.HfApi(endpoint=endpoint, token=token).model_info(ref.repo, files_metadata=True)
        files = [(s.rfilename, s.size, s.lfs.sha256 if s.lfs is not None else None) for s in info.siblings or []]
        if info.sha is None:
            raise ConfigError(f"--model {ref}: {where} names no commit for {ref.repo}", code="hub_error")
        listing = (info.sha, files)
    except hf_errors.GatedRepoError:
        raise fail(f"{ref.repo} is gated on {where}: accept its terms there and set HF_TOKEN", "hub_gated") from None
    except hf_errors.RepositoryNotFoundError:
        path_too = "" if value.startswith("hf:") else f"; nor is there a file {value!r} here"
        raise fail(f"no repository {ref.repo} on {where} (or it is private: set HF_TOKEN){path_too}",
                   "hub_not_found") from None
    except hf_errors.HfHubHTTPError as exc:
        raise fail(f"{where} answered {_status(exc)}", "hub_error") from None
    except network as exc:
        listing = _cached_listing(cache_dir, ref.repo)
        if listing is None:
            raise fail(f"cannot reach {where} ({type(exc).__name__}) and {ref.repo} is not in the cache", "hub_unreachable") from None
        log.warning("cannot reach %s (%s): using %s from the cache", where, type(exc).__name__, ref.repo)
    commit, files = listing
    try:
        filename = choose_file(ref, [f for f, _, _ in files])
    except HubRefError as exc:
        raise ConfigError(f"--model {ref}: {exc}", code="hub_no_such_file") from None
    _, size, sha256 = next(x for x in files if x[0] == filename)
    try:
        path = hf.hf_hub_download(ref.repo, filename, revision=commit, cache_dir=cache, endpoint=endpoint,
                                  token=token, tqdm_class=_bar_class(progress, f"{ref.repo}/{filename}"))
    except hf_errors.HfHubHTTPError as exc:
        raise fail(f"downloading {filename}: {where} answered {_status(exc)}", "hub_error") from None
    except OSError as exc:
        if "Consistency check failed" in str(exc):
            got = str(exc).split("has size", 1)[-1].split("(", 1)[0].strip()
            raise fail(f"the download of {filename} is incomplete: {got} of {size} bytes arrived (the connection "
                       "or the server cut it); nothing was kept: run again", "hub_download_incomplete") from None
        raise fail(f"downloading {filename}: {exc}", "hub_error") from None
    except _transport_errors() as exc:
        raise fail(f"downloading {filename}: {type(exc).__name__}: {exc} (run again to retry)", "hub_unreachable") from None
    return HubFile(ref, ref.repo, filename, commit, Path(str(path)), size, sha256)


def _status(exc: Any) -> str:
    resp = getattr(exc, "response", None)
    code = getattr(resp, "status_code", None)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"HTTP {code}: {first}" if code is not None else first


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client errors huggingface_hub lets through (httpx2 since 2.0, httpx before)."""
    import httpx

    errors: list[type[BaseException]] = [httpx.HTTPError]
    try:
        import httpx2

        errors.append(httpx2.HTTPError)
    except ImportError:
        pass
    return tuple(errors)


def _cached_listing(cache_dir: Path | None, repo: str) -> tuple[str, list[tuple[str, int | None, str | None]]] | None:
    """The files of ``repo`` in the cache (None: not cached): at the commit its ``main`` ref names, else
    the snapshot written last (downloads here are made at a commit, which leaves no ref). Their sha256
    is their blob's name (huggingface_hub names LFS blobs by their sha256)."""
    from huggingface_hub import constants

    root = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    folder = root / ("models--" + repo.replace("/", "--"))
    try:
        snap = folder / "snapshots" / (folder / "refs" / "main").read_text().strip()
    except OSError:
        snaps = [p for p in (folder / "snapshots").glob("*") if p.is_dir()]
        if not snaps:
            return None
        snap = max(snaps, key=lambda p: p.stat().st_mtime)
    if not snap.is_dir():
        return None
    files: list[tuple[str, int | None, str | None]] = []
    for p in sorted(snap.rglob("*")):
        if p.is_file():
            blob = p.resolve().name
            files.append((p.relative_to(snap).as_posix(), p.stat().st_size, blob if len(blob) == 64 else None))
    return snap.name, files
