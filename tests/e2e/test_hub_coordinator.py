"""``moe-swarm coordinator --model ORG/REPO:QUANT`` as a user runs it: a real coordinator process with
``HF_ENDPOINT`` pointing at a local stand-in for the hub (nothing reaches the internet) and the
Hugging Face cache in a temporary folder. It downloads the file llama.cpp's ``-hf`` picks (progress as
plain lines in its log), serves it under a model id keeping the file's base name, and answers the
``openai`` client; a corrupt file is refused with one line and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import trio

from tests.conftest import eventually
from tests.integration.hub_standin import HubFileSpec, start_hub

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::ResourceWarning")]

REPO = "acme/tiny-moe-GGUF"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    from swarm.tools.makemodel import make_model

    d = tmp_path_factory.mktemp("hub")
    return {
        "tiny-moe-F32.gguf": make_model(arch="qwen3moe", size="tiny", seed=7, out=d / "f32.gguf").read_bytes(),
        "tiny-moe-Q8_0.gguf": make_model(arch="qwen3moe", size="tiny", seed=7, out=d / "q8.gguf", qtype="Q8_0").read_bytes(),
    }


def coordinator(tmp_path: Path, hub_url: str, model: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_ENDPOINT": hub_url, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "swarm.cli", "--log-level", "WARNING", "coordinator", "--model",
                                 model, "--port", "0", "--data-dir", str(tmp_path / "c"), "--slots", "1"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)


async def test_a_coordinator_serves_a_model_from_the_hub(nursery: trio.Nursery, files: dict[str, bytes],
                                                        tmp_path: Path) -> None:
    hub = await start_hub(nursery, {REPO: {name: HubFileSpec(data) for name, data in files.items()}})
    log = tmp_path / "coordinator.log"
    p = coordinator(tmp_path, hub.url, REPO, log)  # no quant: Q4_K_M (absent here), then Q8_0
    try:
        async def ready() -> str | None:
            assert p.poll() is None, log.read_text()
            return next((x.split()[-1] for x in log.read_text().splitlines() if x.startswith("coordinator ready at ")), None)

        url = await eventually(ready, within=120, interval=0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        [card] = (await trio.to_thread.run_sync(client.models.list)).data
        assert card.id.startswith("tiny-moe-Q8_0-"), card.id  # the file's base name, then its sha256's start
        # ignore_eos: the random tiny model may sample an end-of-text token first (a flake in CI: 0 tokens)
        r = await trio.to_thread.run_sync(lambda: client.chat.completions.create(
            model="tiny-moe-Q8_0", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"ignore_eos": True}))
        assert r.model == card.id and r.usage is not None and r.usage.completion_tokens == 4
        text = log.read_bytes()
        assert f"[coordinator] downloading {REPO}/tiny-moe-Q8_0.gguf (1.3 MiB)".encode() in text, text
        assert f"[coordinator] downloaded {REPO}/tiny-moe-Q8_0.gguf: 1.3 MiB".encode() in text, text
        assert b"\r" not in text and b"\x1b" not in text  # not a terminal: plain lines only
        assert len(hub.downloads("tiny-moe-Q8_0.gguf")) == 1 and hub.downloads("tiny-moe-F32.gguf") == []
    finally:
        p.terminate()
        p.wait(timeout=30)


async def test_a_corrupt_download_stops_the_coordinator_with_one_line(nursery: trio.Nursery, files: dict[str, bytes],
                                                                      tmp_path: Path) -> None:
    hub = await start_hub(nursery, {REPO: {name: HubFileSpec(data, fault="corrupt") for name, data in files.items()}})
    log = tmp_path / "coordinator.log"
    p = coordinator(tmp_path, hub.url, f"{REPO}:F32", log)
    rc = await trio.to_thread.run_sync(lambda: p.wait(timeout=120))
    lines = log.read_text().splitlines()
    errors = [x for x in lines if x.startswith("moe-swarm: error:")]
    assert rc == 2 and len(errors) == 1, lines
    assert "--model acme/tiny-moe-GGUF:F32: acme/tiny-moe-GGUF/tiny-moe-F32.gguf has sha256" in errors[0]
    assert "a corrupt download, deleted from the cache; run again" in errors[0] and "[hub_download_corrupt]" in errors[0]
    assert "Traceback" not in log.read_text()
    assert not any((tmp_path / "hf").rglob("*.gguf")) and not [b for b in (tmp_path / "hf").rglob("blobs/*")]
