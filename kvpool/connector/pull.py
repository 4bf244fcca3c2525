"""Pull a matched run of blocks from store nodes over the transport (checksums verified by it).

Rules (field cases B17, B18): every read names the slot generation from the match, so a slot reused
after a lease expired answers an error, never someone else's bytes; a failed block is retried once on
another replica (the same one if there is no other, unless it only ran past its deadline while the
store answered: B39); the result is the leading run of blocks that
arrived intact, and blocks after the first failure are discarded even if they arrived. A replica proven
bad (checksum, generation, slot state) is reported to the master so no lookup offers it again; an
unreachable one is not (see `is_replica_fault`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvpool.client.faults import is_replica_fault, is_slow_transfer
from kvpool.connector.ports import MasterPort, TransportPort
from kvpool.types import Location

log = logging.getLogger(__name__)


def _pick(
    replicas: Sequence[Location], addresses: dict[str, str], skip: set[Location], *, fresh_only: bool = False
) -> Location | None:
    usable = [loc for loc in replicas if not loc.local and loc.node_id in addresses]
    fresh = [loc for loc in usable if loc not in skip]
    if fresh:
        return fresh[0]
    return usable[0] if usable and not fresh_only else None


def pull_blocks(
    transport: TransportPort,
    master: MasterPort,
    ns: bytes,
    hashes: Sequence[bytes],
    replicas: Sequence[Sequence[Location]],
    addresses: dict[str, str],
    *,
    start: int,
    end: int,
    block_nbytes: int,
    timeout_s: float,
    request_id: str = "",
    errors: list[str] | None = None,
) -> tuple[list[np.ndarray], int]:
    """Read blocks `start..end` of a match. Returns (leading run of intact blocks, num failed reads).

    `transport` reads the blocks; bad replicas are reported to `master`; `errors` (when given) gets each
    failed read's reason.
    """
    from transfer import BlockRead

    if end <= start:
        return [], 0
    # One buffer for the whole run: the blocks arrive back to back, so the model scatters them without
    # gathering them into one first (kvpool.model.kv.scatter_blocks).
    run_buffer = np.empty((end - start, block_nbytes), dtype=np.uint8)
    buffers = {i: run_buffer[i - start] for i in range(start, end)}
    done: dict[int, bool] = {}
    tried: dict[int, set[Location]] = defaultdict(set)
    slow: set[int] = set()  # missed its deadline while the store answered: retried on another replica only
    num_failed = 0
    pending = list(range(start, end))
    for _attempt in range(2):
        by_peer: dict[str, list[tuple[int, Location]]] = defaultdict(list)
        for i in pending:
            loc = _pick(replicas[i], addresses, tried[i], fresh_only=i in slow)
            if loc is None:
                continue
            tried[i].add(loc)
            by_peer[addresses[loc.node_id]].append((i, loc))

        def read(peer: str, items: list[tuple[int, Location]]) -> list[tuple[int, Location, Any]]:
            reads = [
                BlockRead(loc.slot, loc.generation, block_nbytes, loc.capability, loc.capability_expiry_ms)
                for _, loc in items
            ]
            outs = [memoryview(buffers[i].data) for i, _ in items]
            try:
                results = transport.read_blocks(peer, reads, outs, timeout_s=timeout_s)
            except Exception as exc:  # noqa: BLE001 - a failed batch is a failed block each
                log.warning("[%s] pull from %s failed: %s", request_id, peer, exc)
                return [(i, loc, None) for i, loc in items]
            return [(i, loc, res) for (i, loc), res in zip(items, results, strict=True)]

        with ThreadPoolExecutor(max_workers=max(1, len(by_peer))) as pool:
            batches = list(pool.map(lambda kv: read(*kv), by_peer.items()))
        pending = []
        for batch in batches:
            for i, loc, res in batch:
                if res is not None and res.ok:
                    done[i] = True
                    continue
                num_failed += 1
                pending.append(i)
                reason = res.error if res is not None else "transfer failed"
                if errors is not None:
                    errors.append(reason)
                if is_slow_transfer(reason):  # the same store again would join the same convoy
                    slow.add(i)
                log.debug("[%s] block %d from %s failed: %s", request_id, i, loc.node_id, reason)
                if not is_replica_fault(reason):
                    continue
                try:
                    master.report_bad_replica(ns, hashes[i], loc, reason)
                except Exception as exc:  # noqa: BLE001 - best effort
                    log.debug("report_bad_replica failed: %s", exc)
        if not pending:
            break
    run: list[np.ndarray] = []
    for i in range(start, end):
        if not done.get(i):
            break
        run.append(buffers[i])
    return run, num_failed
