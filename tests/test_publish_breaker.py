"""A publish that probes the pool in degraded mode (B19) and gets the master's refusal, e.g. a new leader
with no store registered yet after a failover, proves the pool reachable: the node leaves degraded mode
(the next requests match again) rather than waiting another probe interval. No answer keeps it degraded."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvpool.connector.breaker import PoolBreaker
from kvpool.connector.local_tier import LocalTier
from kvpool.connector.publish import publish_chain
from kvpool.errors import KVPoolError, NotFound, ResourceExhausted, Unavailable


class RefusingPool:
    def __init__(self, exc: KVPoolError) -> None:
        self.exc, self.calls = exc, 0

    def put_blocks(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise self.exc


def degraded() -> PoolBreaker:
    now = [0.0]
    breaker = PoolBreaker(max_failures=1, probe_interval_s=5.0, clock=lambda: now[0])
    breaker.record(False)
    assert breaker.degraded
    breaker.probe_soon()  # the next pool call is the probe
    return breaker


@pytest.mark.parametrize(
    ("exc", "stays_degraded"),
    [
        (ResourceExhausted("Reserve at master m: no store node can take blocks"), False),
        (NotFound("Reserve at master m: unknown namespace"), False),
        (Unavailable("Reserve at master m: failed to connect"), True),
    ],
)
def test_a_refused_probe_publish_leaves_degraded_mode(exc: KVPoolError, stays_degraded: bool) -> None:
    breaker, pool = degraded(), RefusingPool(exc)
    with pytest.raises(type(exc)):
        publish_chain(
            pool,  # type: ignore[arg-type]
            LocalTier(0),
            breaker,
            b"\x01" * 16,
            [b"\x02" * 16],
            [np.zeros(8, dtype=np.uint8)],
            start_block=0,
            num_replicas=1,
            writer_node_id="n0",
        )
    assert pool.calls == 1 and breaker.degraded is stays_degraded
