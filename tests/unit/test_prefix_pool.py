"""The explicit prefix pool (pure): ids from tokens, fork checks, ownership-attributed bytes, release."""

from __future__ import annotations

import pytest

from coordinator.core.prefix_pool import PoolError, PrefixPool

SALT = b"m"


def test_ids_forks_and_attributed_bytes() -> None:
    pool = PrefixPool(SALT, row_bytes=10)
    root = list(range(1, 21))
    rid = pool.check(root, None, None)
    assert rid == pool.id_for(root) and rid.startswith("pfx-") and len(rid) == 28
    assert pool.id_for(root) != pool.id_for(root[:-1]) and PrefixPool(b"other", 10).id_for(root) != rid
    pool.add(root, None, None, entry=7)
    child = [*root[:12], 99, 98, 97]
    cid = pool.check(child, rid, 12)
    c = pool.add(child, rid, 12, entry=8)
    assert (c.own_kv_bytes, c.subtree_kv_bytes, c.parent, c.fork_at) == (30, 30, rid, 12)  # its 3 rows past D
    grand = [*child, 5, 5]
    g = pool.add(grand, cid, 15, entry=9)
    assert (g.own_kv_bytes, g.subtree_kv_bytes) == (20, 20)
    r = pool.view(rid)
    assert (r.own_kv_bytes, r.subtree_kv_bytes, r.children) == (200, 250, (cid,))  # 20 + 3 + 2 rows, each once
    assert sum(v.own_kv_bytes for v in pool.views()) == r.subtree_kv_bytes


@pytest.mark.parametrize(("tokens", "parent", "fork_at", "code", "status"), [
    ([1, 2, 3, 9], "pfx-none", 3, "prefix_not_found", 404),
    ([1, 2, 3, 9], "ROOT", 0, "invalid_fork", 400),
    ([1, 2, 3, 9], "ROOT", 6, "invalid_fork", 400),  # past the parent's 5 tokens
    ([1, 2], "ROOT", 3, "invalid_fork", 400),  # past the child
    ([1, 2, 3, 9], "ROOT", None, "invalid_fork", 400),
    ([1, 2, 3, 9], None, 3, "invalid_fork", 400),
    ([1, 2, 4, 9], "ROOT", 3, "prefix_mismatch", 409),  # the third token differs
    ([0, 2, 3, 9], "ROOT", 1, "prefix_mismatch", 409),
])
def test_bad_forks(tokens: list[int], parent: str | None, fork_at: int | None, code: str, status: int) -> None:
    pool = PrefixPool(SALT, row_bytes=10)
    root = pool.add([1, 2, 3, 4, 5], None, None, entry=1).id
    with pytest.raises(PoolError) as ei:
        pool.check(tokens, root if parent == "ROOT" else parent, fork_at)
    assert (ei.value.code, ei.value.status) == (code, status)
    assert pool.check([1, 2, 3, 9], root, 3) == pool.id_for([1, 2, 3, 9])  # the boundary itself matches


def test_release_children_first() -> None:
    pool = PrefixPool(SALT, row_bytes=10)
    rid = pool.add([1, 2, 3, 4], None, None, entry=1).id
    cid = pool.add([1, 2, 3, 4, 5], rid, 4, entry=2).id
    with pytest.raises(PoolError) as ei:
        pool.release(rid)
    assert (ei.value.code, ei.value.status) == ("prefix_has_children", 409)
    assert pool.release(cid) == 2 and pool.release(rid) == 1 and pool.views() == []
    with pytest.raises(PoolError) as ei:
        pool.release(rid)
    assert (ei.value.code, ei.value.status) == ("prefix_not_found", 404)
