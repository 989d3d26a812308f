"""Proof of holding (DESIGN §12 "the volunteer proved it holds it"): the digest both sides compute,
the coordinator's book of which listed holdings are proved, and the ``HoldChallenge`` exchange over
the fake and the libp2p transports with the volunteer's real ``ExpertServer``."""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
import pytest
import torch
import trio

from coordinator.core.holdings import HoldBook, Holding
from swarm.errors import SliceError
from swarm.model.gguf import GGUFModel
from swarm.model.slices import cut_slice, hold_digest, load_slice
from swarm.protocol.expert import (
    PROTOCOL_ID,
    ExpertRequest,
    HoldChallenge,
    Pairs,
    Status,
    decode_message,
    encode_message,
    make_hello,
)
from swarm.rpc.client import open_expert_client
from swarm.rpc.server import expert_stream_handler
from tests.sim.test_expert_rpc import KERNEL, Net, clock, kind, net  # noqa: F401  (fixtures)
from volunteer.server import ExpertServer

# -- the digest ------------------------------------------------------------------------------------


def test_the_digest_of_a_volunteers_slice_file_is_the_coordinators(golden_model: GGUFModel) -> None:
    """Computed from the coordinator's GGUF views and from a loaded slice file: equal for every
    window, including windows across the gate/up/down boundaries; nonce and window change it."""
    stack = golden_model.expert_stack(1, 2, 6)
    loaded = load_slice(cut_slice(golden_model, 1, 2, 6)).experts
    g = stack.gate_t.nbytes
    total = stack.nbytes
    nonce = secrets.token_bytes(16)
    windows = [(0, 1), (g - 10, 20), (total - 7, 7), (g + stack.up_t.nbytes - 1, 2), (5, total - 5)]
    for w in windows:
        assert hold_digest(stack, nonce, [w]) == hold_digest(loaded, nonce, [w])
    assert hold_digest(stack, nonce, windows) == hold_digest(loaded, nonce, windows)
    assert hold_digest(stack, nonce, windows) != hold_digest(stack, bytes(16), windows)
    assert hold_digest(stack, nonce, [(0, 64)]) != hold_digest(stack, nonce, [(1, 64)])
    other = load_slice(cut_slice(golden_model, 1, 3, 7)).experts  # same size, other experts
    assert other.nbytes == total and hold_digest(other, nonce, windows) != hold_digest(stack, nonce, windows)
    for bad in [(total - 3, 4), (total, 1)]:
        with pytest.raises(SliceError, match="outside"):
            hold_digest(stack, nonce, [bad])


def test_challenge_fields_are_bounded_on_the_wire() -> None:
    ok = HoldChallenge(request_id=1, attempt=0, model_id="m", layer=0, lo=0, hi=4, nonce=bytes(16), windows=[(0, 4)])
    assert decode_message(encode_message(ok)) == ok
    for bad in [{"nonce": b"short"}, {"windows": []}, {"windows": [(0, 1)] * 17}, {"windows": [(0, 0)]},
                {"unknown": 1}]:
        raw = msgspec.msgpack.encode({**msgspec.to_builtins(ok), "type": "hold_challenge", **bad})
        with pytest.raises(Exception) as info:
            decode_message(raw)
        assert getattr(info.value, "code", "") == "malformed_header"


# -- the book ---------------------------------------------------------------------------------------

H1, H2, H3 = Holding("a", 0, 0, 4), Holding("a", 0, 4, 8), Holding("b", 1, 0, 8)


def test_book_challenges_each_listed_holding_once_until_it_passes_and_backs_off_on_failure() -> None:
    book = HoldBook(retry_base_s=1.0, retry_max_s=4.0)
    book.sync({H1, H2, H3}, now=0.0)
    assert book.due(0.0, limit=2) == [H1, H2]  # oldest listing first, bounded
    assert book.due(0.0, limit=5) == [H3]  # the others are in flight
    assert book.due(0.0, limit=5) == []
    book.passed(H1)
    assert book.held("a", 0, 0, 4) and not book.held("a", 0, 4, 8)
    for k, at in enumerate([0.0, 1.0, 3.0, 7.0, 11.0]):  # backoff 1, 2, 4, capped at 4
        book.failed(H2, at, "timeout")
        wait = min(4.0, 2.0**k)
        assert book.due(at + wait - 0.01, limit=5) == [] and book.next_retry() == pytest.approx(at + wait)
        assert book.due(at + wait, limit=5) == [H2]
    book.refuted(H3, "wrong digest")
    assert book.due(1e9, limit=5) == [] and not book.held("b", 1, 0, 8)
    assert [h for h in book.proven("a")] == [H1] and book.pending("a") == 1
    assert (book.challenges, book.passes, book.failures, book.refutations) == (8, 1, 5, 1)
    # a holding no longer listed is forgotten; listed again, it is challenged afresh
    book.sync({H2, H3}, now=20.0)
    assert not book.held("a", 0, 0, 4)
    book.sync({H1, H2, H3}, now=21.0)
    assert book.due(21.0, limit=5) == [H1]


# -- the exchange ------------------------------------------------------------------------------------


async def test_a_volunteer_answers_hold_challenges_for_what_it_holds_only(
    net: Net, golden_model: GGUFModel  # noqa: F811
) -> None:
    """Real time on both transports: the digest is computed on a worker thread, which virtual time
    would not wait for."""
    server = ExpertServer([load_slice(cut_slice(golden_model, 0, 0, 4))], threads=1)
    allowed = {"yes"}

    async def no_compute(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        raise AssertionError("not asked to compute")

    stack = golden_model.expert_stack(0, 0, 4)
    nonce = secrets.token_bytes(16)

    def ch(i: int, **kw: Any) -> HoldChallenge:
        base: dict[str, Any] = {"request_id": i, "attempt": 0, "model_id": golden_model.model_id, "layer": 0, "lo": 0,
                                "hi": 4, "nonce": nonce, "windows": [(10, 100), (stack.nbytes - 50, 50)]}
        return HoldChallenge(**{**base, **kw})

    async with trio.open_nursery() as n, net.open(name="yes") as me, net.open(name="vol") as vol, \
            net.open(name="other") as stranger:
        await n.start(server.serve)
        vol.set_stream_handler(PROTOCOL_ID, expert_stream_handler(
            no_compute, hello=make_hello(kernel_id=KERNEL),
            authorize=lambda p: p in allowed or p == me.peer_id, prove=server.prove))
        async with open_expert_client(me, vol.peer_id, vol.listen_addrs, kernel_id=KERNEL) as c:
            good = await c.prove_hold(ch(1), timeout=10)
            assert good.status == Status.OK and good.digest == hold_digest(stack, nonce, ch(1).windows)
            other = await c.prove_hold(ch(2, lo=4, hi=8), timeout=10)  # a slice it does not hold
            assert other.status == Status.SLICE_NOT_HELD and other.digest == b""
            past = await c.prove_hold(ch(3, windows=[(stack.nbytes - 1, 2)]), timeout=10)
            assert past.status == "bad_shape" and "outside" in past.message
            assert (await c.prove_hold(ch(4), timeout=10)).digest == good.digest  # the stream goes on
            # part of what it holds (the map split the range where another replica's slice ends):
            # the digest of that part's canonical data, as the coordinator computes it
            part = golden_model.expert_stack(0, 1, 3)
            sub = await c.prove_hold(ch(6, lo=1, hi=3, windows=[(0, 64), (part.nbytes - 9, 9)]), timeout=10)
            assert sub.status == Status.OK and sub.digest == hold_digest(part, nonce, [(0, 64), (part.nbytes - 9, 9)])
            over = await c.prove_hold(ch(7, lo=2, hi=5), timeout=10)  # runs past the held slice
            assert over.status == Status.SLICE_NOT_HELD
        async with open_expert_client(stranger, vol.peer_id, vol.listen_addrs, kernel_id=KERNEL) as c:
            refused = await c.prove_hold(ch(5), timeout=10)
            assert refused.status == Status.NOT_AUTHORIZED
        n.cancel_scope.cancel()


async def test_a_server_without_a_prover_is_not_challenged(net: Net, clock: Any) -> None:  # noqa: F811
    """Its Hello (like an older volunteer's) offers no hold proofs: the client sends no challenge and
    says ``unsupported`` at once, rather than waiting for an answer that cannot come."""
    async def no_compute(req: ExpertRequest, rows: torch.Tensor, pairs: Pairs) -> torch.Tensor:
        raise AssertionError("not asked to compute")

    async with net.open() as me, net.open() as vol:
        vol.set_stream_handler(PROTOCOL_ID, expert_stream_handler(no_compute, hello=make_hello(kernel_id=KERNEL)))
        async with open_expert_client(me, vol.peer_id, vol.listen_addrs, kernel_id=KERNEL) as c:
            p = await c.prove_hold(HoldChallenge(request_id=1, attempt=0, model_id="m", layer=0, lo=0, hi=4,
                                                 nonce=bytes(16), windows=[(0, 1)]), timeout=10)
            assert p.status == Status.UNSUPPORTED and "older volunteer" in p.message
            assert c.peer_hello is not None and c.peer_hello.features == []
