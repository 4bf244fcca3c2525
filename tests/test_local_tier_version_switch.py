"""Once the master makes a namespace unreachable (a version switch, or a flush), a node-local tier never
serves its blocks again (issue #26 item 5: a new user saw `cached_tokens` from node-local tiers after
`admin set-version` said nothing would match).

A real master in-process, a real `MasterLink` heartbeating into a real `KVConnector` (as a serving node
wires them): the heartbeat's flush epoch moves on the switch and the tier is dropped; a node still on the
old version that publishes is refused by the master, and the refused KV leaves its tier too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.client import MasterClient, NodeInfo, PoolClient
from kvpool.client.master_link import MasterLink, new_epoch
from kvpool.connector.connector import KVConnector
from kvpool.connector.local_tier import LocalTier
from kvpool.cost import RecomputeModel
from kvpool.errors import FailedPrecondition
from kvpool.hashing import hash_blocks
from kvpool.master.server import MasterServer, serve
from kvpool.master.settings import MasterSettings

SETTINGS = MasterSettings(port=0, bind_host="127.0.0.1", metrics=False, heartbeat_interval_ms=100)
LAY = SETTINGS.kv_layout
NUM_BLOCKS = 3


@pytest.fixture()
def master() -> Iterator[MasterServer]:
    server = serve(SETTINGS)
    try:
        yield server
    finally:
        server.stop()


def wait_for(predicate: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def fill(conn: KVConnector, ns: bytes, hashes: list[bytes]) -> None:
    """What a serving node's tier holds after computing (or pulling) the chain."""
    for parent, h in zip([None, *hashes], hashes, strict=False):
        assert conn.local_tier.put(ns, h, np.full(LAY.block_nbytes, h[0], np.uint8), parent=parent)


def local_tokens(conn: KVConnector, ns: bytes, tokens: list[int], hashes: list[bytes]) -> int:
    return conn.load_prefix(ns, tokens, hashes, count_hit=True).stats.num_local_tokens


@pytest.mark.parametrize("how", ["set_version", "invalidate"])
def test_a_namespace_made_unreachable_is_never_served_from_the_local_tier(
    master: MasterServer, how: str
) -> None:
    tokens = list(range(LAY.block_size * NUM_BLOCKS + 1))
    with (
        MasterClient(master.address) as c,
        PoolClient(master.address, None, block_nbytes=LAY.block_nbytes) as pool,  # type: ignore[arg-type]
    ):
        old, _ = c.register_namespace("switch", "v1", SETTINGS.layout)
        new, _ = c.register_namespace("switch", "v2", SETTINGS.layout)  # v1 stays active (the first)
        old_hashes = hash_blocks(old, tokens, LAY.block_size)[:NUM_BLOCKS]
        new_hashes = hash_blocks(new, tokens, LAY.block_size)[:NUM_BLOCKS]
        conn = KVConnector(
            master=c,
            pool=pool,
            transport=None,
            node_id="p1",
            block_size=LAY.block_size,
            block_nbytes=LAY.block_nbytes,
            local_tier=LocalTier(64 * LAY.block_nbytes),
            recompute=RecomputeModel(overhead_s=0.001, per_token_s=1e-3, per_pair_s=0.0),
        )
        agent = MasterLink(
            c,
            NodeInfo("p1", "prefill", "127.0.0.1:9", "", new_epoch()),
            layout_fingerprint=SETTINGS.layout,
            on_heartbeat=conn.report_local_events,
            on_flush_epoch=conn.note_flush_epoch,
        )
        agent.start()
        try:
            assert wait_for(lambda: conn.flush_epoch is not None)
            fill(conn, old, old_hashes)
            assert local_tokens(conn, old, tokens, old_hashes) == NUM_BLOCKS * LAY.block_size  # served
            before = conn.flush_epoch
            if how == "set_version":
                c.set_model_version("switch", "v2")
            else:
                c.invalidate(old)
            assert wait_for(lambda: conn.flush_epoch != before), "the heartbeat never saw the switch"
            assert local_tokens(conn, old, tokens, old_hashes) == 0
            assert len(conn.local_tier) == 0

            # a node still computing under the old namespace: the master refuses its KV, so does the tier
            blocks = [np.full(LAY.block_nbytes, 7, np.uint8)] * NUM_BLOCKS
            stale_epoch = before if how == "invalidate" else conn.flush_epoch  # a load begun before the flush
            with pytest.raises(FailedPrecondition):
                conn.publish(old, old_hashes, blocks, start_block=0, flush_epoch=stale_epoch)
            assert local_tokens(conn, old, tokens, old_hashes) == 0 and len(conn.local_tier) == 0

            # the paired positive: the tier still serves what the pool would
            live = new if how == "set_version" else old
            live_hashes = new_hashes if how == "set_version" else old_hashes
            fill(conn, live, live_hashes)
            assert local_tokens(conn, live, tokens, live_hashes) == NUM_BLOCKS * LAY.block_size
        finally:
            agent.stop()
            conn.close()  # the queued lease releases, before the master link closes
