"""``/v1/prefixes`` on a live coordinator (real sockets): create, reuse, fork, release, errors with
stable codes; a request starting with a pinned prefix reports its tokens as cached."""

from __future__ import annotations

from typing import Any

import httpx

GOLDEN_VOCAB = 387
SYSTEM = [(i * 41) % 300 + 20 for i in range(30)]


async def post(h: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await h.post("/v1/prefixes", json=body)


async def test_create_fork_use_and_release(coordinator_url: str) -> None:
    async with httpx.AsyncClient(base_url=coordinator_url, timeout=60) as h:
        r = await post(h, {"tokens": SYSTEM})
        assert r.status_code == 201, r.text
        root = r.json()
        assert root["n_tokens"] == 30 and root["parent"] is None and root["id"].startswith("pfx-")
        again = await post(h, {"tokens": SYSTEM})  # the same tokens: the same prefix
        assert again.status_code == 200 and again.json()["id"] == root["id"]
        # a completion starting with it reuses all of its rows
        c = await h.post("/v1/completions", json={"prompt": [*SYSTEM, 5, 6, 7], "max_tokens": 2, "temperature": 0})
        assert c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 30
        # a fork at 20: its first 20 tokens are the root's
        child_tokens = [*SYSTEM[:20], 1, 2, 3, 4]
        r = await post(h, {"tokens": child_tokens, "parent": root["id"], "fork_at": 20})
        assert r.status_code == 201, r.text
        child = r.json()
        assert (child["parent"], child["fork_at"], child["n_tokens"]) == (root["id"], 20, 24)
        listing = (await h.get("/v1/prefixes")).json()
        by_id = {p["id"]: p for p in listing["data"]}
        row = root["own_kv_bytes"] // 30
        assert by_id[root["id"]]["own_kv_bytes"] == 30 * row and by_id[root["id"]]["subtree_kv_bytes"] == 34 * row
        assert by_id[child["id"]]["own_kv_bytes"] == 4 * row and by_id[root["id"]]["children"] == [child["id"]]
        assert listing["hash_salt"] and len(listing["kept_hashes"]) >= 2
        assert (await h.get(f"/v1/prefixes/{child['id']}")).json()["fork_at"] == 20
        # release: forks first
        r = await h.delete(f"/v1/prefixes/{root['id']}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "prefix_has_children"
        assert (await h.delete(f"/v1/prefixes/{child['id']}")).json() == {"id": child["id"], "object": "prefix",
                                                                          "deleted": True}
        assert (await h.delete(f"/v1/prefixes/{root['id']}")).status_code == 200
        assert (await h.get("/v1/prefixes")).json()["data"] == []
        r = await h.delete(f"/v1/prefixes/{root['id']}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "prefix_not_found"


async def test_a_messages_prefix_is_what_a_chat_starts_with(coordinator_url: str) -> None:
    system = {"role": "system", "content": "You answer in one short sentence, always politely."}
    async with httpx.AsyncClient(base_url=coordinator_url, timeout=60) as h:
        r = await post(h, {"messages": [system]})
        assert r.status_code == 201, r.text
        n = r.json()["n_tokens"]
        chat = await h.post("/v1/chat/completions", json={"messages": [system, {"role": "user", "content": "Hi"}],
                                                          "max_tokens": 2, "temperature": 0})
        assert chat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == n > 5


async def test_bad_prefix_requests(coordinator_url: str) -> None:
    async with httpx.AsyncClient(base_url=coordinator_url, timeout=60) as h:
        root = (await post(h, {"tokens": SYSTEM})).json()["id"]
        cases: list[tuple[dict[str, Any] | bytes, int, str]] = [
            ({"tokens": [*SYSTEM[:9], 0, 1], "parent": root, "fork_at": 10}, 409, "prefix_mismatch"),
            ({"tokens": SYSTEM, "parent": "pfx-000000000000000000000000", "fork_at": 3}, 404, "prefix_not_found"),
            ({"tokens": SYSTEM, "parent": root, "fork_at": 31}, 400, "invalid_fork"),
            ({"tokens": SYSTEM, "parent": root}, 400, "invalid_fork"),
            ({}, 400, "invalid_request"),
            ({"tokens": SYSTEM, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request"),
            ({"tokens": "abc"}, 400, "invalid_request"),
            ({"tokens": SYSTEM, "colour": 1}, 400, "invalid_request"),
            (b"{not json", 400, "invalid_json"),
            ({"tokens": [1, 2]}, 400, "prefix_too_short"),
            ({"tokens": []}, 400, "empty_prompt"),
            ({"tokens": [GOLDEN_VOCAB + 5] * 8}, 400, "invalid_token"),
            ({"tokens": [1] * 5000}, 400, "context_length_exceeded"),
        ]
        for body, status, code in cases:
            r = await (h.post("/v1/prefixes", content=body) if isinstance(body, bytes) else post(h, body))
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (body if isinstance(body, bytes) else
                                                                                 str(body)[:80], r.text)
        r = await h.get("/v1/prefixes/pfx-nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "prefix_not_found"
        assert (await h.get("/health")).status_code == 200  # still serving
