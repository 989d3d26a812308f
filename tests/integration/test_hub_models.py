"""``--model`` from the Hugging Face hub (``swarm.model.hub``), against a local stand-in for the hub
(``tests/integration/hub_standin.py``) serving generated GGUFs: the file llama.cpp's ``-hf`` picks,
downloaded into the cache with its progress counted, a broken transfer continued with ``Range``,
the hub's sha256 checked, truncated and corrupt downloads refused in one line and kept out of the
cache, an unreachable hub served from the cache. Nothing reaches the internet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from swarm.errors import ConfigError
from swarm.model.gguf import file_sha256
from swarm.model.hub import HubFile, is_hub_model, resolve_hub_model
from swarm.progress import Transfers
from tests.integration.hub_standin import COMMIT, HubFileSpec, start_hub

REPO = "acme/tiny-moe-GGUF"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Generated models: tiny in F32 and with Q8_0 experts, small (57 MB: more than huggingface_hub's
    10 MiB download chunk, so a broken transfer can be continued)."""
    from swarm.tools.makemodel import make_model

    d = tmp_path_factory.mktemp("hub")
    return {
        "F32": make_model(arch="qwen3moe", size="tiny", seed=7, out=d / "f32.gguf").read_bytes(),
        "Q8_0": make_model(arch="qwen3moe", size="tiny", seed=7, out=d / "q8.gguf", qtype="Q8_0").read_bytes(),
        "small": make_model(arch="qwen3moe", size="small", seed=3, out=d / "small.gguf").read_bytes(),
    }


def repo(ggufs: dict[str, bytes], faults: dict[str, Any] | None = None) -> dict[str, dict[str, HubFileSpec]]:
    files = {
        "README.md": HubFileSpec(b"# tiny moe\n", lfs=False),
        "tiny-moe-F32.gguf": HubFileSpec(ggufs["F32"]),
        "tiny-moe-Q8_0.gguf": HubFileSpec(ggufs["Q8_0"]),
        "mmproj-tiny-moe-Q8_0.gguf": HubFileSpec(b"not a model"),
        "big/small-moe.gguf": HubFileSpec(ggufs["small"]),
    }
    for name, fault in (faults or {}).items():
        files[name].fault = fault
    return {REPO: files}


async def resolve(value: str, hub_url: str, cache: Path, progress: Transfers | None = None) -> HubFile:
    return await trio.to_thread.run_sync(
        lambda: resolve_hub_model(value, progress=progress, cache_dir=cache, endpoint=hub_url))


def blobs(cache: Path) -> list[str]:
    folder = cache / ("models--" + REPO.replace("/", "--")) / "blobs"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


async def test_the_file_llama_cpp_picks_downloaded_into_the_cache_and_checked(
        nursery: trio.Nursery, ggufs: dict[str, bytes], tmp_path: Path) -> None:
    hub = await start_hub(nursery, repo(ggufs))
    cache = tmp_path / "hf"
    seen: list[tuple[str, int, int | None]] = []
    progress = Transfers(lambda v, event: seen.append((event, v.done, v.total)), min_interval_s=0)
    got = await resolve(REPO, hub.url, cache, progress)  # no quant: Q4_K_M (absent), then Q8_0
    assert got.filename == "tiny-moe-Q8_0.gguf" and got.commit == COMMIT
    assert got.path.name == "tiny-moe-Q8_0.gguf" and got.path.read_bytes() == ggufs["Q8_0"]
    assert got.path.is_relative_to(cache) and blobs(cache) == [got.sha256]  # the blob is named by its sha256
    assert got.sha256 == file_sha256(got.path)
    got.check()  # the hub's sha256: it holds
    assert seen[0] == ("start", 0, len(ggufs["Q8_0"])) and seen[-1] == ("end", len(ggufs["Q8_0"]), len(ggufs["Q8_0"]))
    # the quant, any case; an explicit file; both from the cache once there
    f32 = await resolve(f"{REPO}:f32", hub.url, cache)
    assert f32.filename == "tiny-moe-F32.gguf" and f32.path.read_bytes() == ggufs["F32"]
    again = await resolve(f"hf:{REPO}/tiny-moe-Q8_0.gguf", hub.url, cache)
    assert again.path == got.path and len(hub.downloads("tiny-moe-Q8_0.gguf")) == 1


async def test_a_broken_transfer_is_continued_with_range(nursery: trio.Nursery, ggufs: dict[str, bytes],
                                                        tmp_path: Path) -> None:
    hub = await start_hub(nursery, repo(ggufs, {"big/small-moe.gguf": "cut_once"}))
    got = await resolve(f"hf:{REPO}/big/small-moe.gguf", hub.url, tmp_path / "hf")
    assert got.path.read_bytes() == ggufs["small"]
    first, second = hub.downloads("small-moe.gguf")
    assert first.range is None and second.range is not None  # continued where the first stopped (10 MiB steps)
    start = int(second.range[len("bytes="):-1])
    assert 0 < start < len(ggufs["small"]) and start % (10 << 20) == 0, second.range


@pytest.mark.parametrize(("fault", "code", "words"), [
    ("truncated", "hub_download_incomplete", "is incomplete: 1676736 of 2515104 bytes arrived"),
    ("corrupt", "hub_download_corrupt", "a corrupt download, deleted from the cache; run again"),
])
async def test_truncated_and_corrupt_downloads_are_refused_in_one_line(
        nursery: trio.Nursery, ggufs: dict[str, bytes], tmp_path: Path, fault: str, code: str, words: str) -> None:
    hub = await start_hub(nursery, repo(ggufs, {"tiny-moe-F32.gguf": fault}))
    cache = tmp_path / "hf"
    with pytest.raises(ConfigError) as err:
        got = await resolve(f"{REPO}:F32", hub.url, cache)
        got.check()  # the coordinator checks as it hashes the loaded model; the same check
    assert err.value.code == code and words in err.value.message and "\n" not in err.value.message, err.value.message
    assert err.value.message.startswith(f"--model {REPO}:F32: ")
    assert blobs(cache) == []  # nothing left in the cache: the next run downloads anew
    hub.repos[REPO]["tiny-moe-F32.gguf"].fault = None
    fixed = await resolve(f"{REPO}:F32", hub.url, cache)
    fixed.check()
    assert fixed.path.read_bytes() == ggufs["F32"]


async def test_unknown_repos_files_and_quants_say_what_there_is(nursery: trio.Nursery, ggufs: dict[str, bytes],
                                                               tmp_path: Path) -> None:
    hub = await start_hub(nursery, repo(ggufs))
    cases = [
        ("acme/nothing-here", "hub_not_found", "no repository acme/nothing-here on http://127.0.0.1"),
        (f"{REPO}:Q4_K_M", "hub_no_such_file",
         "no GGUF file for quant Q4_K_M; its GGUF files: big/small-moe.gguf, mmproj-tiny-moe-Q8_0.gguf"),
        (f"hf:{REPO}/nope.gguf", "hub_no_such_file", "has no file 'nope.gguf'"),
        ("hf:acme", "bad_model_ref", "not a Hugging Face reference"),
    ]
    for value, code, words in cases:
        with pytest.raises(ConfigError) as err:
            await resolve(value, hub.url, tmp_path / "hf")
        assert err.value.code == code and words in err.value.message, (value, err.value.message)


async def test_an_unreachable_hub_serves_what_the_cache_holds(nursery: trio.Nursery, ggufs: dict[str, bytes],
                                                             tmp_path: Path) -> None:
    hub = await start_hub(nursery, repo(ggufs))
    cache = tmp_path / "hf"
    got = await resolve(f"{REPO}:Q8_0", hub.url, cache)
    with trio.socket.socket() as s:  # a port nobody listens on
        await s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    offline = await resolve(f"{REPO}:Q8_0", closed, cache)
    assert offline.path == got.path and offline.sha256 == got.sha256
    offline.check()
    with pytest.raises(ConfigError, match="cannot reach .* and acme/other is not in the cache") as err:
        await resolve("acme/other", closed, cache)
    assert err.value.code == "hub_unreachable"


def test_what_is_a_hub_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert is_hub_model("acme/model") and is_hub_model("hf:acme/model/m.gguf")
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "model").write_bytes(b"GGUF")
    assert not is_hub_model("acme/model")  # an existing file is that file
    assert is_hub_model("hf:acme/model")  # unless hf: says otherwise
