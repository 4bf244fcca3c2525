"""A store's death in a real `Master` (no store processes: its blocks go straight into the index): the replicas
are hidden the moment it is declared dead, its rows leave in steps with the index consistent between them,
the orphans' slots on the surviving store are queued as free orders (columns), the blocks that keep a replica
reach re-replication, and the lock-hold figures are kept."""

from __future__ import annotations

import pytest

from kvpool.index import node_removal
from kvpool.master import node_death
from kvpool.master.core import Master
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.types import BlockHash, FakeClock, Location, NamespaceId
from tests.test_master_bounded_cycles import register
from tests.test_master_bounded_state import FP, LAY, chain, settings


def _store(m: Master, node_id: str) -> None:
    m.register_node(
        node_id=node_id,
        role="store",
        grpc_address=f"127.0.0.1:{1 if node_id == 's0' else 2}",
        data_address="127.0.0.1:3",
        epoch=1,
        protocol_version=PROTOCOL_VERSION,
        layout_fingerprint=FP,
        num_slots=1024,
        block_nbytes=LAY.block_nbytes,
    )


def test_a_dead_store_leaves_in_steps_hidden_at_once_frees_queued_survivors_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(node_removal, "STEP_ROWS", 3)
    monkeypatch.setattr(node_removal, "SCAN_ROWS", 8)
    m = Master(settings(replicas=2), clock=FakeClock(1_000_000))
    _store(m, "s0")
    _store(m, "s1")
    for rec in m.st.nodes.values():
        rec.ready = True
    ns = register(m)
    nid = NamespaceId(ns)
    tops = [chain(ns, 100 * i, 1)[0] for i in range(20)]
    kids: list[BlockHash] = []
    with m.lock:
        for i, top in enumerate(tops):  # a block on s0 alone, with 3 children on s1 below it
            m.index.insert(nid, [top], parent=None, locations=[[Location("s0", i, 1)]], size_bytes=8)
            below = chain(ns, 100 * i + 1, 3)
            m.index.insert(
                nid,
                below,
                parent=top,
                locations=[[Location("s1", 100 + 3 * i + j, 1)] for j in range(3)],
                size_bytes=8,
            )
            kids.extend(below)
        both = chain(ns, 5000, 1)
        m.index.insert(
            nid, both, parent=None, locations=[[Location("s0", 900, 1), Location("s1", 900, 1)]], size_bytes=8
        )
        m.index.set_block_meta(nid, both, [7], 2)
        m.declare_dead(m.st.nodes["s0"])
    res, _ = m.match(ns, [tops[0]], count_hit=False, lease_ttl_ms=0, num_prompt_tokens=0)
    assert res.num_matched == 0  # hidden at once, before any step
    res, _ = m.match(ns, both, count_hit=False, lease_ttl_ms=0, num_prompt_tokens=0)
    assert res.locations == [(Location("s1", 900, 1),)]
    steps = 0
    while node_death.step_node_removal(m):  # one lock hold each; between them:
        steps += 1
        m.index.check_invariants()
        for top, i in zip(tops, range(0, 60, 3), strict=True):
            res, _ = m.match(
                ns, [top, *kids[i : i + 3]], count_hit=False, lease_ttl_ms=0, num_prompt_tokens=0
            )
            assert res.num_matched == 0
    assert steps > 10 and m.index.num_blocks == 1
    assert sorted(s for s, _ in m.st.free_q["s1"]) == list(range(100, 160))  # the orphans below s0's blocks
    assert "s0" not in m.st.free_q  # never an order to the dead store
    with m.lock:
        assert node_death.take_under_replicated(m, 10) == [(ns, bytes(both[0]))]
    holds = m.lock_holds
    assert holds.num_node_deaths == 1 and holds.node_death_steps == steps + 1 and holds.node_death_s > 0
