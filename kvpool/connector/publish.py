"""Publish a chain of full blocks to the pool (docs/design.md "How a request flows", step 2), off the TTFT path.

The blocks go into the node-local tier first (reported to the master once committed), then reserve →
write → commit through the pool client. KV the master refuses as such (a namespace fenced by a version
switch, or invalidated since the load it was computed from) leaves the node-local tier too: the tier never
serves what the pool would not. A partial failure aborts the reservation, so nothing is half-visible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool.client.types import PutResult
from kvpool.connector.breaker import PoolBreaker
from kvpool.connector.local_tier import LocalTier
from kvpool.connector.ports import PoolPort
from kvpool.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    KVPoolError,
    TransferError,
    Unavailable,
    VersionFenced,
)


def refuses_the_kv(exc: FailedPrecondition) -> bool:
    """A publish refused for its KV itself (a fenced namespace: not of its model's active version, or
    one invalidated since the load), not for a lapse of the write (an expired lease, a stale slot)."""
    return isinstance(exc, VersionFenced) or "invalidated" in str(exc)


def publish_chain(
    pool: PoolPort | None,
    local_tier: LocalTier,
    breaker: PoolBreaker,
    ns: bytes,
    hashes: Sequence[bytes],
    blocks: Sequence[np.ndarray],
    *,
    start_block: int,
    num_replicas: int,
    writer_node_id: str,
    recompute_cost_s: Sequence[float] | None = None,
    flush_epoch: int | None = None,
) -> tuple[int, int]:
    """Publish blocks `start_block..` of the chain `hashes` (`blocks[i]` is block `start_block + i`, uint8
    arrays of the layout's block bytes) with `num_replicas` replicas each. `flush_epoch`: the
    `LoadedPrefix.flush_epoch` of the load the blocks were computed from (a namespace invalidated since
    refuses them; None: unchecked). `recompute_cost_s[i]`: seconds to recompute block i (eviction's value).

    Returns (num committed, num already present). Raises a `KVPoolError` on failure: `Unavailable` while
    `breaker` holds the pool unreachable, `TransferError` when blocks could not be written, the master's
    refusal otherwise.
    """
    mine = list(hashes[start_block : start_block + len(blocks)])
    parent = hashes[start_block - 1] if start_block > 0 else None
    local_tier.put_chain(ns, parent, mine, blocks, report=False)  # reported once committed
    try:
        result = _put(
            pool,
            breaker,
            ns,
            parent,
            mine,
            blocks,
            num_replicas=num_replicas,
            writer_node_id=writer_node_id,
            recompute_cost_s=recompute_cost_s,
            flush_epoch=flush_epoch,
        )
    except FailedPrecondition as exc:
        if refuses_the_kv(exc):
            local_tier.discard(ns, mine)
        raise
    finally:
        local_tier.report_stored(ns, mine)
    if result is None:
        return 0, 0
    if result.num_failed:
        raise TransferError(f"{result.num_failed} of {len(blocks)} blocks could not be written")
    return result.num_committed, result.num_existing


def _put(
    pool: PoolPort | None,
    breaker: PoolBreaker,
    ns: bytes,
    parent: bytes | None,
    mine: list[bytes],
    blocks: Sequence[np.ndarray],
    *,
    num_replicas: int,
    writer_node_id: str,
    recompute_cost_s: Sequence[float] | None,
    flush_epoch: int | None,
) -> PutResult | None:
    """The pool write (None: nothing to write); records the outcome in the breaker."""
    if not blocks:
        return None
    if not breaker.allow():
        raise Unavailable("pool unreachable (degraded mode): not publishing")
    if pool is None:
        raise FailedPrecondition("this connector has no pool client: it loads, never publishes")
    try:
        result = pool.put_blocks(
            ns,
            parent,
            mine,
            list(blocks),
            num_replicas=num_replicas,
            recompute_cost_s=list(recompute_cost_s or ()),
            writer_node_id=writer_node_id,
            flush_epoch=flush_epoch,
        )
    except (Unavailable, DeadlineExceeded):
        breaker.record(False)
        raise
    except TransferError:
        raise
    except KVPoolError:  # the master answered with a refusal (a new leader that has no store yet): reachable
        breaker.record(True)
        raise
    breaker.record(True)
    return result
