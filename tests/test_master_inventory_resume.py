"""A restarted master adopts a real store's inventory batch by batch (many messages), keeps answering matches
with what it indexed so far while the store stalls mid-stream, and resumes the broken stream from its
cursor once the store answers again (real processes: a `kvpool store` with a tiny layout; the master in
process, restarted on its port). The fault is real: the store process is stopped (SIGSTOP) right after the
master received the inventory's first message, so the per-message deadline expires on a real stream."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.client import MasterClient, PoolClient
from kvpool.master import MasterSettings, serve
from kvpool.master.procs import start_store
from kvpool.master.stores import StoreCalls
from kvpool.types import InventoryBatch, KVLayout
from tests.capabilities import require_ucx
from tests.test_master_failures import free_port

TINY = "kv1:float16:b1:l1:h1:d1"
LAY = KVLayout.from_fingerprint(TINY)
CHAIN = 256
NUM_CHAINS = 24
transfer = pytest.importorskip("transfer")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _settings(port: int, **kw: object) -> MasterSettings:
    return MasterSettings(port=port, layout=TINY, metrics=False, rebuild_grace_ms=120_000, **kw)  # type: ignore[arg-type]


@pytest.fixture
def transport() -> Iterator[object]:
    require_ucx()
    t = transfer.UcxTransport()
    yield t
    t.close()


def test_adoption_resumes_a_broken_inventory_and_answers_matches_meanwhile(
    transport: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = serve(_settings(port))
    store = None
    try:
        store = start_store(address, "s0", segment="1MiB", layout=TINY)
        with MasterClient(address) as c:
            ns, _ = c.register_namespace("resume", "v1", TINY)
        rng = np.random.default_rng(3)
        chains = [[rng.bytes(16) for _ in range(CHAIN)] for _ in range(NUM_CHAINS)]
        data = [np.zeros(LAY.block_nbytes, np.uint8)] * CHAIN
        with PoolClient(address, transport, block_nbytes=LAY.block_nbytes) as w:
            for chain in chains:
                assert w.put_blocks(ns, None, chain, data).num_committed == CHAIN
        server.stop()

        # the next master stops the store right after the inventory's first message reached it
        pid = int(store.ready["pid"])
        real = StoreCalls.inventory
        stopped: list[int] = []

        def first_message_then_stall(
            self: StoreCalls, addr: str, *, after_slot: int = 0
        ) -> Iterator[InventoryBatch]:
            for batch in real(self, addr, after_slot=after_slot):
                if not stopped:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(after_slot)
                yield batch

        monkeypatch.setattr(StoreCalls, "inventory", first_message_then_stall)
        server = serve(
            # the stopped store stays offered to readers (a silent store's replicas leave the matches after
            # stale_after_ms: not what this test is about)
            _settings(
                port,
                inventory_batch_blocks=16,
                store_timeout_s=1.0,
                heartbeat_timeout_ms=60_000,
                stale_after_ms=60_000,
            )
        )
        m = server.master
        adoption = server.maintenance.adoption
        with MasterClient(address) as c:
            assert c.register_namespace("resume", "v1", TINY)[0] == ns  # as serving nodes re-register theirs
        try:
            _wait(lambda: adoption.stats.num_inventory_resumes >= 2, 60, "the stalled stream retried")
            with m.lock:
                rec = m.st.nodes["s0"]
                assert not rec.ready and rec.free.num_slots > 0  # still adopting: nothing placeable
                partial = m.index.num_blocks
            assert 0 < partial < NUM_CHAINS * CHAIN  # what arrived before the stall is indexed
            with MasterClient(address) as c:
                hits = [c.match(ns, chain).num_matched for chain in chains]
            assert sum(hits) > 0  # matches answered during the adoption, from what is indexed so far
        finally:
            os.kill(pid, signal.SIGCONT)
        _wait(lambda: m.st.nodes["s0"].ready, 60, "the adoption completes")
        assert stopped == [0] and adoption.stats.resumed_from[0] > 0  # resumed from the cursor, not slot 0
        assert adoption.stats.num_adopted_blocks == NUM_CHAINS * CHAIN  # each block indexed once
        with m.lock:
            assert m.index.num_blocks == NUM_CHAINS * CHAIN
            assert m.st.nodes["s0"].num_allocated == NUM_CHAINS * CHAIN
        with MasterClient(address) as c:
            assert [c.match(ns, chain).num_matched for chain in chains] == [CHAIN] * NUM_CHAINS
    finally:
        server.stop()
        if store is not None:
            store.kill()
