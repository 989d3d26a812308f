"""Ctrl-C on a volunteer answers the calls in flight before the host goes away."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
import trio

from swarm.model.gguf import GGUFModel
from swarm.model.slices import cut_slice, load_slice
from swarm.p2p.libp2p import open_libp2p_transport
from swarm.protocol.expert import ExpertRequest, RequestId, make_hello, make_pairs
from swarm.rpc.client import open_expert_client
from swarm.rpc.server import set_expert_handlers
from tests.conftest import eventually
from volunteer import server as server_mod
from volunteer.server import ExpertServer, shielded_until_cancelled


@pytest.mark.parametrize("shielded", [True, False])
async def test_cancel_drains_calls_in_flight(golden_model: GGUFModel, monkeypatch: Any, shielded: bool) -> None:
    real = server_mod._SliceWorker._compute
    computing, release = threading.Event(), threading.Event()
    gate = {"on": False}

    def gated(self: Any, batch: Any) -> Any:
        if gate["on"]:  # a long expert computation, in its worker thread: it ends when the test says
            computing.set()
            assert release.wait(30)
        return real(self, batch)

    monkeypatch.setattr(server_mod._SliceWorker, "_compute", gated)
    # computed in a worker thread (never on the event loop, however small): the gate blocks it there
    server = ExpertServer([load_slice(cut_slice(golden_model, 0, 0, 8))], threads=1, inline_macs=0)
    vol_scope = trio.CancelScope()

    async def volunteer(task_status: trio.TaskStatus[tuple[str, list[str]]]) -> None:
        with vol_scope:
            if shielded:
                async with shielded_until_cancelled() as stop, open_libp2p_transport(key_path=None) as t, \
                        trio.open_nursery() as n:
                    await n.start(server.serve)
                    set_expert_handlers(t, server.handle, hello=make_hello(kernel_id=server.kernel_id))
                    task_status.started((t.peer_id, t.listen_addrs))
                    await stop.wait()
                    assert await server.drain(5)
                    n.cancel_scope.cancel()
            else:  # what a plain cancellation does: host and compute go down at once
                async with open_libp2p_transport(key_path=None) as t, trio.open_nursery() as n:
                    await n.start(server.serve)
                    set_expert_handlers(t, server.handle, hello=make_hello(kernel_id=server.kernel_id))
                    task_status.started((t.peer_id, t.listen_addrs))
                    await trio.sleep_forever()

    x = torch.randn(2, golden_model.config.d_model)
    req = ExpertRequest(request_id=RequestId(1), attempt=0, model_id=golden_model.model_id, layer=0, lo=0, hi=8,
                        n_rows=2, d_model=golden_model.config.d_model, n_pairs=3, dtype="float32")
    pairs = make_pairs(np.array([0, 0, 1]), np.array([0, 3, 7]), np.array([0.5, 0.5, 1.0]))
    async with trio.open_nursery() as nursery:
        peer, addrs = await nursery.start(volunteer)
        async with open_libp2p_transport(key_path=None) as ct, open_expert_client(ct, peer, addrs) as client:
            first = await client.call(req, x, pairs, timeout=5)  # connected and warm
            gate["on"] = True

            async def ctrl_c_while_computing() -> None:
                await trio.to_thread.run_sync(computing.wait)  # the second call is in its compute thread
                vol_scope.cancel()
                if shielded:  # the volunteer saw the stop: draining, its host still up

                    async def draining() -> bool:
                        return server.draining

                    await eventually(draining)
                release.set()  # only now the computation may finish

            nursery.start_soon(ctrl_c_while_computing)
            req2 = ExpertRequest(**{**{f: getattr(req, f) for f in req.__struct_fields__}, "request_id": RequestId(2)})
            if shielded:
                out = await client.call(req2, x, pairs, timeout=20)
                assert torch.equal(out, first)  # the answer of the call that was in flight at Ctrl-C
                assert server.stats.calls == 2 and server.draining
            else:
                from swarm.errors import TransportError

                with pytest.raises(TransportError):
                    await client.call(req2, x, pairs, timeout=20)
