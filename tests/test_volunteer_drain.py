"""Ctrl-C on a volunteer answers the calls in flight before the host goes away."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import trio

from swarm.model.gguf import GGUFModel
from swarm.model.slices import cut_slice, load_slice
from swarm.p2p.libp2p import open_libp2p_transport
from swarm.protocol.expert import PROTOCOL_ID, ExpertRequest, RequestId, make_hello
from swarm.rpc.client import open_expert_client
from swarm.rpc.server import expert_stream_handler
from volunteer import server as server_mod
from volunteer.server import ExpertServer, shielded_until_cancelled


@pytest.mark.parametrize("shielded", [True, False])
async def test_cancel_drains_calls_in_flight(golden_model: GGUFModel, monkeypatch: Any, shielded: bool) -> None:
    real = server_mod._SliceWorker._compute

    def slow(self: Any, batch: Any) -> Any:
        time.sleep(0.5)  # a long expert computation, in its worker thread
        return real(self, batch)

    monkeypatch.setattr(server_mod._SliceWorker, "_compute", slow)
    server = ExpertServer([load_slice(cut_slice(golden_model, 0, 0, 8))], threads=1)
    vol_scope = trio.CancelScope()

    async def volunteer(task_status: trio.TaskStatus[tuple[str, list[str]]]) -> None:
        with vol_scope:
            if shielded:
                async with shielded_until_cancelled() as stop, open_libp2p_transport(key_path=None) as t, \
                        trio.open_nursery() as n:
                    await n.start(server.serve)
                    t.set_stream_handler(PROTOCOL_ID, expert_stream_handler(server.handle, hello=make_hello()))
                    task_status.started((t.peer_id, t.listen_addrs))
                    await stop.wait()
                    assert await server.drain(5)
                    n.cancel_scope.cancel()
            else:  # what a plain cancellation does: host and compute go down at once
                async with open_libp2p_transport(key_path=None) as t, trio.open_nursery() as n:
                    await n.start(server.serve)
                    t.set_stream_handler(PROTOCOL_ID, expert_stream_handler(server.handle, hello=make_hello()))
                    task_status.started((t.peer_id, t.listen_addrs))
                    await trio.sleep_forever()

    x = torch.randn(2, golden_model.config.d_model)
    req = ExpertRequest(request_id=RequestId(1), attempt=0, model_id=golden_model.model_id, layer=0, lo=0, hi=8,
                        n_rows=2, dtype="float32", d_model=golden_model.config.d_model,
                        experts=[[0, 3], [7]], weights=[[0.5, 0.5], [1.0]])
    async with trio.open_nursery() as nursery:
        peer, addrs = await nursery.start(volunteer)
        async with open_libp2p_transport(key_path=None) as ct, open_expert_client(ct, peer, addrs) as client:
            await client.call(req, x, timeout=5)  # connected and warm

            async def stop_soon() -> None:
                await trio.sleep(0.2)
                vol_scope.cancel()  # Ctrl-C while the next call computes

            nursery.start_soon(stop_soon)
            req2 = ExpertRequest(**{**{f: getattr(req, f) for f in req.__struct_fields__}, "request_id": RequestId(2)})
            if shielded:
                out = await client.call(req2, x, timeout=5)
                assert out.shape == x.shape and bool(torch.isfinite(out).all())
                assert server.stats.calls == 2 and server.draining
            else:
                from swarm.errors import TransportError

                with pytest.raises(TransportError):
                    await client.call(req2, x, timeout=5)
