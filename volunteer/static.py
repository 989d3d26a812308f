"""Volunteer, static mode (shell): fetch the slices named on the command line, serve them.

``moe-swarm volunteer --coordinator URL --slice LAYER:LO-HI [--slice ...] [--listen MULTIADDR]
[--relay MULTIADDR ...] [--no-direct] [--no-hole-punch] [--data-dir DIR]``

Rules:
- Slices are downloaded from the coordinator (resumable, sha256-verified against the ETag) into
  ``DATA_DIR/slices/<model_id>/`` and reused on the next start without a download.
- The libp2p identity persists in ``DATA_DIR/identity.key``: a restarted volunteer keeps its
  peer id, so dispatch maps that name it stay valid.
- Behind a NAT (``--relay``): the volunteer asks its relays whether it is reachable, reserves a
  slot on them if not, and advertises its ``/p2p-circuit`` addresses (``swarm.p2p.nat``); with
  ``--no-direct`` it does not listen at all and is reachable only through its relays.
- Once serving, ``DATA_DIR/volunteer.json`` holds the peer id and the advertised addresses (for
  scripts that build dispatch maps) and one status line is printed to stdout. The file is
  rewritten whenever the addresses change (a reservation lost after a relay restart, regained).
- Cancellation (Ctrl-C) drains: requests already accepted are answered before the host closes.
"""

from __future__ import annotations

import logging
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Annotated

import httpx
import msgspec
import trio

from swarm.config import HttpUrl, Multiaddr, PosFloat
from swarm.errors import ConfigError, UnsafePath
from swarm.model.fetch import fetch_slice
from swarm.model.kernels import DEFAULT_BACKEND, KernelBackend
from swarm.model.slices import LoadedSlice, load_slice, parse_slice_arg
from swarm.p2p.nat import Nat, NatConfig, open_listener_host, parse_relay_addr
from swarm.progress import show_transfers
from swarm.protocol.status import VolunteerInfo, encode_info
from swarm.rpc.server import set_expert_handlers
from swarm.safe_paths import slice_file
from volunteer.lanes import VolunteerLanes
from volunteer.server import ExpertServer, shielded_until_cancelled

__all__ = ["StaticVolunteerConfig", "check_config", "serve_static_volunteer"]

log = logging.getLogger(__name__)


class StaticVolunteerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``moe-swarm volunteer --coordinator URL --slice ...``'s settings (built by ``volunteer.cli``)."""

    coordinator: HttpUrl
    slices: tuple[str, ...]
    listen: tuple[Multiaddr, ...] = ("/ip4/127.0.0.1/tcp/0",)
    data_dir: str
    model_id: str | None = None
    threads: Annotated[int, msgspec.Meta(ge=1, le=256)] = 2
    progress: bool = True
    status_interval_s: PosFloat = 10.0
    relays: tuple[Multiaddr, ...] = ()  # reserve on these when not reachable directly
    hole_punch: bool = True
    lanes: bool = True  # dial the data lanes the coordinator offers (volunteer.lanes)
    kernel: KernelBackend = DEFAULT_BACKEND  # expert kernels: ggml or the torch reference
    # libp2p peers whose expert calls are answered besides the coordinator's own (from its /health)
    allow_peers: tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=128)], ...] = ()


async def _model_id(client: httpx.AsyncClient, base: str, wanted: str | None) -> str:
    try:
        r = await client.get(f"{base}/v1/models")
        r.raise_for_status()
        ids = [m["id"] for m in r.json()["data"]]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise ConfigError(f"cannot list the coordinator's models at {base}: {exc}") from exc
    if wanted is not None:
        if wanted not in ids:
            raise ConfigError(f"the coordinator does not host {wanted!r} (it hosts {ids})")
        return wanted
    if len(ids) != 1:
        raise ConfigError(f"the coordinator hosts {len(ids)} models; choose one with --model-id ({ids})")
    return str(ids[0])


async def _coordinator_peer(client: httpx.AsyncClient, base: str, allow: tuple[str, ...]) -> list[str]:
    """The coordinator's libp2p peer id from its ``/health`` (none if it names none and ``allow`` is given)."""
    try:
        r = await client.get(f"{base}/health")
        r.raise_for_status()
        peer = r.json().get("peer_id")
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        raise ConfigError(f"cannot read the coordinator's /health at {base}: {exc}") from exc
    if isinstance(peer, str) and peer:
        return [peer]
    if allow:
        return []
    raise ConfigError(f"the coordinator at {base} names no peer id on /health: give the ids allowed to call with --allow-peer")


async def fetch_and_load(
    client: httpx.AsyncClient, base: str, model_id: str, slice_args: tuple[str, ...], data_dir: Path, *, progress: bool
) -> list[LoadedSlice]:
    loaded = []
    for arg in slice_args:
        layer, lo, hi = parse_slice_arg(arg)
        try:
            dest = slice_file(data_dir, model_id, layer, lo, hi)  # the coordinator's model id is a string from the network
        except UnsafePath as exc:
            raise ConfigError(f"the coordinator's model id cannot name a file: {exc.message}") from exc
        url = f"{base}/v1/slices/{model_id}/{layer}/{lo}-{hi}"
        if progress:  # bars on a terminal, plain lines elsewhere (swarm.progress)
            with show_transfers(prefix="[volunteer] ") as transfers:
                path = await fetch_slice(client, url, dest, progress=transfers)
        else:
            path = await fetch_slice(client, url, dest)
        sl = await trio.to_thread.run_sync(load_slice, path)
        if sl.key.model_id != model_id or (sl.key.layer, sl.key.lo, sl.key.hi) != (layer, lo, hi):
            raise ConfigError(f"{dest} holds {sl.key}, not {model_id} {arg}")
        loaded.append(sl)
    return loaded


async def serve_static_volunteer(
    cfg: StaticVolunteerConfig, *, task_status: trio.TaskStatus[VolunteerInfo] = trio.TASK_STATUS_IGNORED
) -> None:
    data_dir = Path(cfg.data_dir)  # expanded at the edge (CLI)
    await trio.Path(data_dir).mkdir(parents=True, exist_ok=True)
    base = cfg.coordinator.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=10.0)) as client:
        model_id = await _model_id(client, base, cfg.model_id)
        allowed = frozenset({*cfg.allow_peers, *await _coordinator_peer(client, base, cfg.allow_peers)})
        slices = await fetch_and_load(client, base, model_id, cfg.slices, data_dir, progress=cfg.progress)
    server = ExpertServer(slices, threads=cfg.threads, kernel=cfg.kernel)
    nat_cfg = NatConfig(relays=cfg.relays, hole_punch=cfg.hole_punch)
    async with shielded_until_cancelled() as stop, \
            open_listener_host(key_path=data_dir / "identity.key", listen_addrs=cfg.listen, cfg=nat_cfg) as (transport, nat):
        # only the coordinator (and --allow-peer ids) may use our experts: anyone else gets not_authorized
        host = urllib.parse.urlsplit(base).hostname or ""
        lanes = VolunteerLanes(server, authorize=allowed.__contains__, known_hosts=lambda: {host})
        set_expert_handlers(transport, server.handle_timed, hello=server.hello(),
                            authorize=allowed.__contains__, prove=server.prove, lanes=lanes.offer if cfg.lanes else None)
        log.info("answering expert calls from %s", ", ".join(sorted(allowed)))
        info = VolunteerInfo(peer_id=transport.peer_id, addrs=list(nat.advertised), reachability=nat.reachability.value,
                             model_id=model_id, slices=[str(s.key) for s in slices])
        await trio.Path(data_dir / "volunteer.json").write_bytes(encode_info(info))
        print(f"volunteer ready peer_id={transport.peer_id} addrs={','.join(nat.advertised) or 'none (no relay answered yet)'} "
              f"reachability={nat.reachability.value} slices={','.join(str(s.key) for s in slices)}", flush=True)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            if cfg.lanes:
                await nursery.start(lanes.serve)
            nursery.start_soon(_status_loop, server, transport.peer_id, cfg.status_interval_s, nat)
            nursery.start_soon(_publish_addrs, nat, info, data_dir / "volunteer.json")
            task_status.started(info)
            await stop.wait()  # Ctrl-C / SIGTERM: the host and compute loops keep running while we drain
            ok = await server.drain()
            log.info("drained (%s); %d calls served", "clean" if ok else "timed out", server.stats.calls)
            nursery.cancel_scope.cancel()


async def _status_loop(server: ExpertServer, peer_id: str, interval_s: float, nat: Nat) -> None:
    while True:
        await trio.sleep(interval_s)
        s = server.stats
        ago = f"{time.monotonic() - s.last_call_at:.1f}s ago" if s.last_call_at else "never"
        relays = "".join(f" | relay {r.relay.rsplit('/', 1)[-1][-8:]}: {r.state}"
                         + (f" (expires in {r.expires_in_s:.0f}s)" if r.expires_in_s is not None else "")
                         + (f" (failures {r.failures}: {r.last_error})" if r.failures else "")
                         for r in nat.relay_status())
        print(f"[volunteer {peer_id[-8:]}] serving {len(server.slices)} slice(s) | calls {s.calls} rows {s.rows} "
              f"batches {s.batches} errors {s.errors} latency {s.latency_ewma_ms:.1f}ms | last call {ago}{relays}", file=sys.stderr, flush=True)


async def _publish_addrs(nat: Nat, info: VolunteerInfo, path: Path) -> None:
    """Keep ``volunteer.json`` (and the person watching) up to date with the advertised addresses."""
    while True:
        await nat.changed.wait()
        addrs = list(nat.advertised)
        if addrs == info.addrs:
            continue
        info.addrs = addrs
        await trio.Path(path).write_bytes(encode_info(info))
        print(f"[volunteer] addresses now: {', '.join(addrs) or 'none (waiting for a relay)'}", file=sys.stderr, flush=True)


def check_config(cfg: StaticVolunteerConfig) -> None:
    if not cfg.slices:
        raise ConfigError("give at least one --slice LAYER:LO-HI")
    if not cfg.listen and not cfg.relays:
        raise ConfigError("--no-direct needs at least one --relay MULTIADDR: nobody could reach this volunteer")
    for r in cfg.relays:
        parse_relay_addr(r)
    for s in cfg.slices:
        parse_slice_arg(s)

