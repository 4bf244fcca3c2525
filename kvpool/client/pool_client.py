"""`PoolClient`: read and publish whole KV blocks (master for placement, a `Transport` for bytes).

`get_blocks`: match under a read lease, read each block from one of its replicas (checksums verified by
the transport, generations by the store), fall back to another replica, report replicas that failed
(so the next lookup does not offer them: B18), release the lease. A read that outlives its lease counts
as failed (B17). `put_blocks`: reserve, write each replica, commit what landed; abort on failure. A write
the store refused or lost is reported to the master off the request path (`kvpool.client.reports`), which
stops placing on a store whose data plane fails (`kvpool.master.dataplane`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import numpy as np

from kvpool import capability
from kvpool.client.faults import is_replica_fault, write_fault_kind
from kvpool.client.master_client import MasterClient
from kvpool.client.reports import DataPlaneReporter
from kvpool.client.types import BlockGet, CommitBlock, GetResult, Match, PutResult
from kvpool.errors import InvalidArgument, KVPoolError
from kvpool.types import Location
from transfer.base import BlockRead, BlockWrite, Transport
from transfer.xxh3 import as_bytes_view, checksums

log = logging.getLogger(__name__)


class PoolClient:
    """Thread-safe if `transport` is. Owns its `MasterClient` (closed by `close()`), not the transport."""

    def __init__(
        self,
        master_address: str,
        transport: Transport,
        *,
        block_nbytes: int,
        timeout_s: float = 5.0,
        transfer_timeout_s: float = 10.0,
        lease_ttl_ms: int = 30_000,
    ) -> None:
        if block_nbytes <= 0:
            raise InvalidArgument("block_nbytes must be > 0")
        self.master = MasterClient(master_address, timeout_s=timeout_s)
        self.transport = transport
        self.block_nbytes = block_nbytes
        self.transfer_timeout_s = transfer_timeout_s
        self.lease_ttl_ms = lease_ttl_ms
        self.reports = DataPlaneReporter(self.master.report_dataplane_failure)

    def close(self) -> None:
        self.master.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- read -------------------------------------------------------------------------------------
    def get_blocks(
        self,
        namespace: bytes,
        block_hashes: Sequence[bytes],
        *,
        count_hit: bool = True,
        num_prompt_tokens: int = 0,
        max_blocks: int | None = None,
    ) -> GetResult:
        """Read the matched prefix of `block_hashes` (at most `max_blocks`); one `BlockGet` per block."""
        match = self.master.match(
            namespace,
            block_hashes,
            count_hit=count_hit,
            lease_ttl_ms=self.lease_ttl_ms,
            num_prompt_tokens=num_prompt_tokens,
        )
        try:
            return self.read_matched(namespace, block_hashes, match, max_blocks=max_blocks)
        finally:
            if match.lease_id is not None:
                try:
                    self.master.release_lease(match.lease_id)
                except KVPoolError as exc:  # it expires on its own
                    log.warning("release of lease %d failed: %s", match.lease_id, exc)

    def read_matched(
        self, namespace: bytes, block_hashes: Sequence[bytes], match: Match, *, max_blocks: int | None = None
    ) -> GetResult:
        """Read the blocks of a match the caller holds a lease for (the caller releases it)."""
        started = time.monotonic()
        n = match.num_matched if max_blocks is None else min(match.num_matched, max_blocks)
        bufs = [np.empty(self.block_nbytes, dtype=np.uint8) for _ in range(n)]
        ok = [False] * n
        errors = [""] * n
        tried: list[set[Location]] = [set() for _ in range(n)]
        while True:
            plan: dict[str, list[tuple[int, Location]]] = {}
            for i in range(n):
                if ok[i]:
                    continue
                loc = self._pick(match, i, tried[i])
                if loc is None:
                    errors[i] = errors[i] or "no readable replica"
                    continue
                tried[i].add(loc)
                plan.setdefault(match.data_address(loc.node_id), []).append((i, loc))
            if not plan:
                break
            for peer, items in plan.items():
                reads = [
                    BlockRead(
                        loc.slot, loc.generation, self.block_nbytes, loc.capability, loc.capability_expiry_ms
                    )
                    for _, loc in items
                ]
                out = [as_bytes_view(bufs[i]) for i, _ in items]
                results = self.transport.read_blocks(peer, reads, out, timeout_s=self.transfer_timeout_s)
                for (i, loc), res in zip(items, results, strict=True):
                    if res.ok:
                        ok[i] = True
                        continue
                    errors[i] = res.error or "read failed"
                    # only a replica proven bad is reported: not a refused capability, not a peer this
                    # reader cannot reach (that may be its own network; dead nodes miss heartbeats)
                    if is_replica_fault(errors[i]) and not capability.refused(errors[i]):
                        self._report(namespace, block_hashes[i], loc, errors[i])
        if match.lease_id is not None and (time.monotonic() - started) * 1000 > self.lease_ttl_ms:
            return GetResult(
                match.num_matched, [BlockGet(block_hashes[i], False, error="lease expired") for i in range(n)]
            )
        blocks = [
            BlockGet(block_hashes[i], True, bufs[i].tobytes())
            if ok[i]
            else BlockGet(block_hashes[i], False, error=errors[i])
            for i in range(n)
        ]
        return GetResult(match.num_matched, blocks)

    @staticmethod
    def _pick(match: Match, i: int, tried: set[Location]) -> Location | None:
        for loc in match.replicas[i]:
            if not loc.local and loc not in tried and match.data_address(loc.node_id):
                return loc
        return None

    def _report(self, namespace: bytes, block_hash: bytes, loc: Location, reason: str) -> None:
        try:
            self.master.report_bad_replica(namespace, block_hash, loc, reason)
        except KVPoolError as exc:
            log.warning("could not report bad replica %s: %s", loc, exc)

    # ---- write ------------------------------------------------------------------------------------
    def put_blocks(
        self,
        namespace: bytes,
        parent: bytes | None,
        block_hashes: Sequence[bytes],
        blocks: Sequence[bytes | np.ndarray | memoryview],
        *,
        num_replicas: int = 0,
        recompute_cost_s: Sequence[float] = (),
        writer_node_id: str = "",
        flush_epoch: int | None = None,
    ) -> PutResult:
        """Publish a chain of blocks below `parent` (None: the namespace root). `flush_epoch`: the master's
        flush epoch when the blocks were computed (a namespace invalidated since refuses them).

        Blocks already in the pool are not written again. Raises `kvpool.errors` when the master
        refuses (fenced version, no capacity...); a partial write commits the leading run that landed.
        """
        if len(blocks) != len(block_hashes):
            raise InvalidArgument(f"{len(blocks)} blocks for {len(block_hashes)} hashes")
        views = [as_bytes_view(b) for b in blocks]
        for i, v in enumerate(views):
            if v.nbytes != self.block_nbytes:
                raise InvalidArgument(
                    f"blocks[{i}] is {v.nbytes} B, the pool's blocks are {self.block_nbytes} B"
                )
        res = self.master.reserve(
            namespace,
            parent,
            block_hashes,
            num_replicas=num_replicas,
            block_nbytes=self.block_nbytes,
            recompute_cost_s=recompute_cost_s,
            writer_node_id=writer_node_id,
            flush_epoch=flush_epoch,
        )
        if res.reservation_id == 0:
            return PutResult(0, len(block_hashes), 0, 0)
        try:
            sums = checksums(views)  # on the hashing threads, GIL released
            plan: dict[str, list[tuple[int, Location]]] = {}
            for i, b in enumerate(res.blocks):
                for loc in b.locations:
                    node = res.nodes.get(loc.node_id)
                    if node is not None:
                        plan.setdefault(node.data_address, []).append((i, loc))
            written: list[list[Location]] = [[] for _ in res.blocks]
            for peer, items in plan.items():
                writes = [
                    BlockWrite(
                        loc.slot, loc.generation, views[i], sums[i], loc.capability, loc.capability_expiry_ms
                    )
                    for i, loc in items
                ]
                results = self.transport.write_blocks(peer, writes, timeout_s=self.transfer_timeout_s)
                for (i, loc), r in zip(items, results, strict=True):
                    if r.ok:
                        written[i].append(loc)
                    else:
                        log.warning("write of block %d to %s failed: %s", i, loc.node_id, r.error)
                        if kind := write_fault_kind(r.error):  # the store's data plane, not this writer
                            node = res.nodes[loc.node_id]
                            self.reports.report(loc.node_id, node.epoch, kind, r.error)
            to_commit = [
                CommitBlock(b.block_hash, sums[i], tuple(written[i]))
                for i, b in enumerate(res.blocks)
                if written[i] or b.already_present
            ]
            # committed even when nothing landed (not aborted): the master counts the unwritten slots per
            # store (a store whose writes keep failing gets no new reservations: kvpool.master.dataplane)
            done = self.master.commit(res.reservation_id, to_commit)
        except BaseException:
            with contextlib.suppress(KVPoolError):
                self.master.abort(res.reservation_id)
            raise
        failed = len(block_hashes) - done.num_committed - done.num_existing
        return PutResult(done.num_committed, done.num_existing, failed, res.num_replicas_placed)

    # ---- other ------------------------------------------------------------------------------------
    def exists(self, namespace: bytes, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks are in the pool (a peek: no counters, no lease)."""
        return self.master.match(namespace, block_hashes).num_matched

    def remove(self, namespace: bytes, block_hashes: Sequence[bytes], *, force: bool = False) -> int:
        """Remove blocks (each with its descendants); leased ones only with `force`."""
        return self.master.remove(namespace, block_hashes, force=force)
