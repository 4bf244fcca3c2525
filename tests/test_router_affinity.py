"""The router's own record of where recent prefixes went (`kvpool.router.affinity`): placement without
peeks while the master is unreachable. Pure data structure tests; the live behaviour is in
`tests/test_router_master_down.py` and `tests/test_master_outage_e2e.py`."""

from __future__ import annotations

from kvpool.client.types import NodeInfo, NodeLoad, NodeStatus
from kvpool.router.affinity import NODES_PER_BLOCK, AffinityRecord
from kvpool.router.state import Inflight, local_runs, node_states


def _node(node_id: str, epoch: int = 1) -> NodeStatus:
    info = NodeInfo(node_id=node_id, role="prefill", grpc_address="127.0.0.1:1", data_address="", epoch=epoch)
    return NodeStatus(node=info, alive=True, draining=False, num_slots=0, num_used_slots=0, num_blocks=0,
                      used_bytes=0, load=NodeLoad())  # fmt: skip


H = [bytes([i]) * 16 for i in range(8)]


def test_the_leading_recorded_blocks_are_local_runs_of_the_nodes_that_served_them() -> None:
    rec = AffinityRecord(100)
    assert rec.match(H[:4]) is None
    rec.record(H[:4], _node("p0"))
    rec.record(H[:2], _node("p1"))  # a shorter prompt with the same first two blocks, on p1
    m = rec.match(H[:6])
    assert m is not None and m.num_matched == 4  # blocks 4 and 5 were never served
    epochs = {"p0": 1, "p1": 1}
    assert local_runs(m, epochs, 6) == {"p0": 4, "p1": 2}
    states = {s.node_id: s.local_blocks for s in node_states([_node("p0"), _node("p1")], m, Inflight(), 6)}
    assert states == {"p0": 4, "p1": 2}


def test_a_restarted_node_attracts_nothing_for_blocks_its_old_epoch_held() -> None:
    rec = AffinityRecord(100)
    rec.record(H[:3], _node("p0", epoch=1))
    m = rec.match(H[:3])
    assert local_runs(m, {"p0": 2}, 3) == {}  # p0 is listed with epoch 2 now: its tier is empty
    assert local_runs(m, {"p0": 1}, 3) == {"p0": 3}


def test_bounded_in_blocks_and_nodes_per_block() -> None:
    rec = AffinityRecord(4)
    rec.record(H[:8], _node("p0"))
    assert len(rec) == 4 and rec.match(H[:8]) is None  # the first blocks went out first (LRU)
    assert rec.match(H[4:8]) is not None and rec.match(H[4:8]).num_matched == 4  # type: ignore[union-attr]
    for i in range(NODES_PER_BLOCK + 3):
        rec.record(H[4:5], _node(f"p{i}"))
    m = rec.match(H[4:5])
    assert m is not None
    held = [loc.node_id for loc in m.replicas[0]]
    assert len(held) == NODES_PER_BLOCK and held[0] == f"p{NODES_PER_BLOCK + 2}"  # the latest first
