"""The coordinator service (shell): model + engine runtime + HTTP API on hypercorn's trio worker.

Rules:
- Configuration is a frozen Struct built once at the edge (CLI) and passed down by value.
- ``serve_coordinator`` is a trio service: ``task_status.started(url)`` once the HTTP socket is
  bound and the engine thread runs; cancelling it shuts both down cleanly.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve

from coordinator.api import build_app
from coordinator.runtime import EngineRuntime
from swarm.gguf_model import GGUFModel
from swarm.tokenizer import Tokenizer

__all__ = ["CoordinatorConfig", "load_runtime", "serve_coordinator"]

log = logging.getLogger(__name__)


class CoordinatorConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    slots: int = 4
    ctx_size: int | None = None
    n_batch: int = 512
    max_queue: int = 64
    data_dir: str | None = None


def load_runtime(cfg: CoordinatorConfig) -> EngineRuntime:
    model = GGUFModel(Path(cfg.model))
    tok = Tokenizer.from_gguf_fields(model.fields)
    return EngineRuntime(model, tok, n_slots=cfg.slots, n_ctx=cfg.ctx_size, n_batch=cfg.n_batch, max_queue=cfg.max_queue)


async def serve_coordinator(cfg: CoordinatorConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    rt = await trio.to_thread.run_sync(load_runtime, cfg)
    app = build_app(rt, model_id=rt.model.model_id, aliases=[rt.model.path.stem])
    hc = HyperConfig()
    hc.bind = [f"{cfg.host}:{cfg.port}"]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.graceful_timeout = 2.0
    async with trio.open_nursery() as nursery:
        await nursery.start(rt.serve)
        binds = await nursery.start(hypercorn_serve, app, hc)
        url = binds[0] if binds else f"http://{cfg.host}:{cfg.port}"
        log.info("coordinator serving %s at %s (%d slots, ctx %d)", rt.model.model_id, url, rt.n_slots, rt.n_ctx)
        task_status.started(url)
