"""No file path from a network string: a hostile market cannot make a volunteer create or write
anything outside its data directory (issue 31, item 3).

A hostile market stand-in (a real HTTP server on loopback) answers the volunteer's signed polls with
assignments whose ``model_id`` is a path: ``../../../../x``, absolute, ``..``, encoded or backslashed
separators, NUL, a newline, very long, unicode lookalikes; and negative or empty ranges. Two gates,
each tested on its own: the wire refuses such an assignment at decoding (the volunteer reports the
market confused and polls again later), and where the path is made (``swarm.safe_paths``) the same
strings -- handed straight to the download, past the decoder -- are refused before anything is
created. The slice the stand-in serves at the assignment's URL is real bytes with a matching sha256,
so before the fix the volunteer wrote it outside its data dir and left it there.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from swarm.errors import UnsafePath
from swarm.p2p.identity import load_or_create_identity, peer_id_of
from swarm.protocol.market import Assignment, NothingNeeded
from swarm.safe_paths import inside, safe_name, slice_file
from volunteer.core.lifecycle import Offer
from volunteer.daemon import PullVolunteer, PullVolunteerConfig
from volunteer.server import ExpertServer

BLOB = b"not a slice file, but its sha256 matches" * 64
BLOB_SHA = hashlib.sha256(BLOB).hexdigest()

HOSTILE_IDS = [
    "../../../../x",
    "../x",
    "..",
    ".",
    "",
    "a/../../../../x",
    "/tmp/moe-swarm-hostile-absolute",  # absolute (a tmp_path one is added per test)
    "..%2f..%2f..%2fx",
    "%2e%2e%2f%2e%2e%2fx",
    "..\\..\\..\\x",
    "a\x00b",
    "abc\n",
    "x" * 5000,
    "．．／．．／x",  # fullwidth lookalikes of ../../x
    "‥/x",  # two dot leader
    "a/b",
    "-rf",
]


def assignment(model_id: str, *, layer: int = 0, lo: int = 0, hi: int = 4, url: str = "http://127.0.0.1:1/slice") -> dict[str, Any]:
    return {"kind": "assignment", "model_id": model_id, "layer": layer, "lo": lo, "hi": hi, "slice": f"{layer}:{lo}-{hi}",
            "url": url, "size": len(BLOB), "sha256": BLOB_SHA, "lease_id": "0123456789abcdef",
            "lease_expires_in_s": 30.0, "scarcity": 1.0, "relays": [], "heartbeat_s": 5.0,
            "coordinator": "http://127.0.0.1:1", "sources": []}


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


class HostileMarket:
    def __init__(self) -> None:
        self.answers: list[dict[str, Any]] = []
        self.polls = 0
        self.polled = trio.Event()
        self.url = ""

    def app(self) -> Starlette:
        async def volunteer(request: Request) -> Response:
            await request.body()
            self.polls += 1
            self.polled.set()
            return JSONResponse(self.answers.pop(0) if self.answers else
                                {"kind": "nothing_needed", "reason": "nothing_scarce", "retry_after_s": 60.0})

        async def slice_bytes(_: Request) -> Response:
            return Response(BLOB, headers={"etag": f'"{BLOB_SHA}"'}, media_type="application/octet-stream")

        async def other(_: Request) -> Response:
            return JSONResponse({"error": {"message": "no", "code": "not_found"}}, status_code=404)

        return Starlette(routes=[Route("/api/expert-volunteer", volunteer, methods=["POST"]),
                                 Route("/slice", slice_bytes, methods=["GET"]),
                                 Route("/api/expert-coverage", other, methods=["POST"]),
                                 Route("/api/models/{m}/manifest", other, methods=["GET"])])


@pytest.fixture
async def hostile(nursery: trio.Nursery) -> AsyncIterator[HostileMarket]:
    m = HostileMarket()
    hc = HyperConfig()
    hc.bind = ["127.0.0.1:0"]
    hc.accesslog = None
    binds = await nursery.start(hypercorn_serve, m.app(), hc)
    m.url = binds[0]
    yield m


async def make_volunteer(tmp_path: Path, market: str, nursery: trio.Nursery, client: httpx.AsyncClient) -> PullVolunteer:
    data = tmp_path / "a" / "b" / "data"
    data.mkdir(parents=True)
    kp = load_or_create_identity(tmp_path / "identity.key")
    cfg = PullVolunteerConfig(market=market, data_dir=str(data), max_bytes=1 << 30, poll_interval_s=0.05,
                              progress=False)
    nat = SimpleNamespace(advertised=(), reachability=SimpleNamespace(value="unknown"))
    return PullVolunteer(cfg, epoch=1, key_pair=kp, peer_id=peer_id_of(kp), nat=nat,  # type: ignore[arg-type]
                         server=ExpertServer([], threads=1), client=client, nursery=nursery)


def offer_of(a: dict[str, Any]) -> Offer:
    return Offer(model_id=a["model_id"], layer=a["layer"], lo=a["lo"], hi=a["hi"], url=a["url"], sha256=a["sha256"],
                 size=a["size"], lease_expires_in_s=a["lease_expires_in_s"], heartbeat_s=a["heartbeat_s"],
                 lease_id=a["lease_id"])


def hostile_answers(tmp_path: Path, url: str) -> list[dict[str, Any]]:
    ids = [*HOSTILE_IDS, str(tmp_path / "absolute-target"), str(tmp_path)]
    return [*(assignment(mid, url=url) for mid in ids),
            assignment("good-0123456789ab", layer=-1, url=url),
            assignment("good-0123456789ab", lo=4, hi=4, url=url),
            assignment("good-0123456789ab", lo=-4, hi=0, url=url)]


def test_the_wire_refuses_every_hostile_assignment(tmp_path: Path) -> None:
    decoder = msgspec.json.Decoder(Assignment | NothingNeeded)
    for a in hostile_answers(tmp_path, "http://127.0.0.1:1/slice"):
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(msgspec.json.encode(a))
    ok = decoder.decode(msgspec.json.encode(assignment("good-0123456789ab")))
    assert isinstance(ok, Assignment) and ok.model_id == "good-0123456789ab"


async def test_a_hostile_market_makes_the_volunteer_poll_again_not_write(tmp_path: Path, hostile: HostileMarket) -> None:
    async with httpx.AsyncClient(timeout=5) as client, trio.open_nursery() as nursery:
        vol = await make_volunteer(tmp_path, hostile.url, nursery, client)
        before = tree(tmp_path)
        hostile.answers = [assignment("../../../../x", url=f"{hostile.url}/slice")]
        [poll] = vol.core.start(trio.current_time())
        await vol._poll_at(poll.at)  # type: ignore[attr-defined]
        assert hostile.polls == 1
        assert vol.core.fetching is None and not vol.core.holdings
        assert "confused" in vol.status  # and a poll is scheduled again (backoff): the volunteer keeps going
        assert vol.core.next_poll is not None
        nursery.cancel_scope.cancel()
    assert tree(tmp_path) == before


async def test_paths_from_the_market_are_checked_where_they_are_made(tmp_path: Path, hostile: HostileMarket) -> None:
    """Past the decoder (as if it let them through), every hostile id or range is refused by the
    download itself: nothing is created, inside the data dir or out, and the volunteer keeps serving."""
    async with httpx.AsyncClient(timeout=5) as client, trio.open_nursery() as nursery:
        vol = await make_volunteer(tmp_path, hostile.url, nursery, client)
        data = Path(vol.cfg.data_dir)
        before = tree(tmp_path)
        for a in hostile_answers(tmp_path, f"{hostile.url}/slice"):
            offer = offer_of(a)
            now = trio.current_time()
            vol.core.start(now)
            vol.core.offered(offer, now)
            await vol._fetch(offer)  # type: ignore[attr-defined]
            assert vol.core.fetching is None and offer.key not in vol.core.holdings, a["model_id"][:40]
            assert tree(tmp_path) == before, (a["model_id"][:40], tree(tmp_path) - before)
        assert not (data / "slices").exists()
        # an honest id still downloads (into the data dir: the bytes are no slice, so it is refused after)
        good = offer_of(assignment("good-0123456789ab", url=f"{hostile.url}/slice"))
        vol.core.offered(good, trio.current_time())
        await vol._fetch(good)  # type: ignore[attr-defined]
        assert (data / "slices" / "good-0123456789ab" / "0-0-4.safetensors").is_file()
        assert {p for p in tree(tmp_path) - before if not p.startswith(os.path.join("a", "b", "data"))} == set()
        nursery.cancel_scope.cancel()


def test_safe_paths_rules(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    for bad in HOSTILE_IDS:
        with pytest.raises(UnsafePath):
            safe_name(bad)
        with pytest.raises(UnsafePath):
            slice_file(root, bad, 0, 0, 4)
    for layer, lo, hi in ((-1, 0, 4), (0, 4, 4), (0, 5, 4), (0, -1, 2)):
        with pytest.raises(UnsafePath):
            slice_file(root, "m-0123", layer, lo, hi)
    assert slice_file(root, "m-0123", 2, 0, 4) == root.resolve() / "slices" / "m-0123" / "2-0-4.safetensors"
    # a symlink inside the data dir that points out of it is caught by resolving
    (root / "slices").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (root / "slices" / "m-link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePath, match="outside"):
        slice_file(root, "m-link", 0, 0, 4)
    with pytest.raises(UnsafePath):
        inside(root, "ok", "..")
    assert list((tmp_path / "elsewhere").iterdir()) == []
