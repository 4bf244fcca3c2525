"""A pull that only ran past its deadline while the store answered (the transport's `TransferTimedOut`, a
convoy: B39) recomputes, but is no pool failure: the breaker stays closed and the same store is not asked
again at once. A lost store (`PeerLost`) still counts and is retried once. The transport's side, with
real UCX: tests/test_transfer_convoy.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvpool.connector.breaker import PoolBreaker
from kvpool.connector.plan import LoadPlan, LoadStats
from kvpool.types import Location
from tests.test_connector import NBYTES, NS, make
from transfer import BlockRead, BlockResult


class FailingTransport:
    """Every read fails with `error` (the kind of failure the real transport reports), counted."""

    def __init__(self, error: str) -> None:
        self.error = error
        self.calls = 0

    def read_blocks(
        self, peer: str, reads: Sequence[BlockRead], out: Sequence[memoryview], *, timeout_s: float
    ) -> list[BlockResult]:
        self.calls += 1
        return [BlockResult(False, error=f"transfer to {peer} failed: {self.error}")] * len(reads)


class NoMaster:
    def report_bad_replica(self, *args: Any) -> None:
        raise AssertionError("an unreachable or slow store is no bad replica")


def _plan() -> LoadPlan:
    hashes = [bytes([i]) * 16 for i in range(2)]
    return LoadPlan(
        ns=NS,
        stats=LoadStats(),
        hashes=hashes,
        num_pool_blocks=2,
        num_load_blocks=2,
        replicas=[(Location("s1", i, 1),) for i in range(2)],
        addresses={"s1": "127.0.0.1:1"},
        pull_timeout_s=0.25,
    )


@pytest.mark.parametrize(
    ("error", "degraded", "reads_per_pull"),
    [
        ("TransferTimedOut: deadline passed while the store was answering", False, 1),
        ("PeerLost: connection lost: Endpoint timeout", True, 2),
    ],
)
def test_slow_pulls_recompute_without_tripping_the_breaker(
    error: str, degraded: bool, reads_per_pull: int
) -> None:
    conn = make(NoMaster(), breaker=PoolBreaker(max_failures=3, probe_interval_s=60.0))
    transport = FailingTransport(error)
    conn.transport = transport
    conn.block_nbytes = NBYTES
    for _ in range(5):
        assert conn.pull(_plan()) == []  # nothing pulled: the caller recomputes
    assert conn.breaker.degraded is degraded
    assert transport.calls == 5 * reads_per_pull
