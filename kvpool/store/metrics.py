"""A store node's Prometheus metrics.

Occupancy (slots used/free, bytes, in-flight transfers) is read from the slot table at scrape time.
Data-plane traffic is counted by `MeteredHandler`, the `transfer.BlockHandler` the UCX block server is
given: it forwards every call to the slot table and counts the blocks it served (reads), the blocks that
landed intact (writes), their bytes, and the refusals. Same-host readers that map the segment and its
slot state copy without asking the store (transfer/slot_state.py): their reads are not counted here
(their own link metrics count them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.store.slots import SlotTable
from kvpool.store.tier_moves import TierMoves

P = "kvpool_store_"


class StoreCollector(Collector):
    """Slot-table gauges, read at scrape time (with a disk tier: per medium, and the tier's counters)."""

    def __init__(self, table: SlotTable, moves: TierMoves | None = None) -> None:
        self.table = table
        self.moves = moves

    def _disk(self) -> Iterator[Metric]:
        t, disk = self.table, self.table.disk
        if disk is None:
            return
        c = disk.tier.counters
        blocks = GaugeMetricFamily(
            P + "medium_blocks", "Blocks held (memory: used slots).", labels=["medium"]
        )
        blocks.add_metric(["memory"], t.num_used)
        blocks.add_metric(["disk"], c.resident_blocks)
        yield blocks
        nbytes = GaugeMetricFamily(P + "medium_bytes", "Bytes of blocks held.", labels=["medium"])
        nbytes.add_metric(["memory"], t.num_used * t.block_nbytes)
        nbytes.add_metric(["disk"], c.resident_bytes)
        yield nbytes
        yield GaugeMetricFamily(P + "disk_slots", "Slots of the disk tier.", value=disk.num_slots)
        yield GaugeMetricFamily(
            P + "disk_degraded",
            "1 when the disk tier refuses writes (a disk fault).",
            value=int(bool(disk.tier.degraded)),
        )
        yield GaugeMetricFamily(
            P + "disk_buffer_bytes", "Disk bounce buffers in use.", value=disk.buffer_bytes
        )
        for name, value, text in (
            ("disk_read_blocks", c.read_blocks, "Blocks read from disk and verified."),
            ("disk_written_blocks", c.written_blocks, "Blocks written to disk and recorded."),
            (
                "disk_dropped_blocks",
                c.dropped_blocks,
                "Disk blocks dropped: their bytes failed their checksum.",
            ),
            ("disk_errors", c.io_errors, "Failed disk system calls (ENOSPC, EIO, EROFS...)."),
            ("disk_refused_reads", disk.refused_reads, "Disk reads refused (damaged bytes, a failed disk)."),
        ):
            yield CounterMetricFamily(P + name, text, value=value)
        if self.moves is not None:
            m = self.moves.counters
            for name, value, text in (
                ("demotions", m.demoted_blocks, "Blocks moved from memory to disk on the master's order."),
                ("promotions", m.promoted_blocks, "Blocks moved from disk to memory on the master's order."),
                ("stale_moves", m.stale_moves, "Tier moves discarded: a generation moved or a free came."),
                ("failed_moves", m.failed_moves, "Tier moves that failed (destination, disk or checksum)."),
                ("refused_move_orders", m.refused_orders, "Tier move orders refused: the queue was full."),
            ):
                yield CounterMetricFamily(P + name, text, value=value)
            yield GaugeMetricFamily(
                P + "queued_move_blocks", "Tier moves queued.", value=self.moves.queued_blocks
            )

    def collect(self) -> Iterator[Metric]:
        t = self.table
        used = t.num_used
        yield GaugeMetricFamily(P + "slots", "Slots in the segment.", value=t.num_slots)
        yield GaugeMetricFamily(P + "used_slots", "Slots reserved, written or committed.", value=used)
        yield GaugeMetricFamily(P + "free_slots", "Free slots.", value=t.num_slots - used)
        yield GaugeMetricFamily(P + "block_bytes", "Bytes per block (slot).", value=t.block_nbytes)
        yield GaugeMetricFamily(
            P + "capacity_bytes", "Bytes of the segment's slots.", value=t.num_slots * t.block_nbytes
        )
        yield GaugeMetricFamily(P + "used_bytes", "Bytes of used slots.", value=used * t.block_nbytes)
        yield GaugeMetricFamily(
            P + "inflight_transfers", "Block reads and writes in flight.", value=t.num_inflight
        )
        yield GaugeMetricFamily(
            P + "leader_epoch",
            "The newest master leader epoch this store took an order from (0: a single master).",
            value=t.fence.highest,
        )
        yield CounterMetricFamily(
            P + "fenced_orders",
            "Orders refused because they carried an older leader epoch than one already taken (a deposed "
            "or partitioned master's).",
            value=t.fence.num_refused,
        )
        yield CounterMetricFamily(
            P + "unproven_epochs",
            "Orders refused because they carried a newer leader epoch without the leader's proof of it (a "
            "forged order or etcd key; secured stores only).",
            value=t.fence.num_unproven,
        )
        accepted = CounterMetricFamily(
            P + "orders_accepted",
            "Orders (reserve, commit, free, copy) taken, per leader epoch of the master that sent them.",
            labels=["epoch"],
        )
        for epoch, n in sorted(t.fence.accepted_by_epoch().items()):
            accepted.add_metric([str(epoch)], n)
        yield accepted
        yield from self._disk()


class StoreMetrics:
    """One registry per store node: the slot-table collector plus data-plane counters."""

    def __init__(self, table: SlotTable, moves: TierMoves | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        r.register(StoreCollector(table, moves))
        self.blocks = Counter(
            P + "blocks_served",
            "Blocks read (granted to a reader) or written (landed intact) through the data plane server "
            "(same-host readers that copy without asking are not seen).",
            ["op"],
            registry=r,
        )
        self.bytes = Counter(P + "served_bytes", "Bytes of blocks read or written.", ["op"], registry=r)
        self.errors = Counter(
            P + "transfer_errors", "Block reads or writes refused or failed.", ["op"], registry=r
        )


class MeteredHandler:
    """A `transfer.BlockHandler` that forwards to `table` and counts into `metrics` (thread-safe)."""

    def __init__(self, table: SlotTable, metrics: StoreMetrics) -> None:
        self._table = table
        self._nbytes = table.block_nbytes
        self._blocks = {op: metrics.blocks.labels(op) for op in ("read", "write")}
        self._bytes = {op: metrics.bytes.labels(op) for op in ("read", "write")}
        self._errors = {op: metrics.errors.labels(op) for op in ("read", "write")}

    def begin_read(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = self._table.begin_read(*args, **kwargs)
        except Exception:
            self._errors["read"].inc()
            raise
        self._blocks["read"].inc()
        self._bytes["read"].inc(self._nbytes)
        return out

    def begin_reads(self, reads: Any) -> list[Any]:
        out = self._table.begin_reads(reads)
        num_ok = sum(1 for r in out if not isinstance(r, Exception))
        if num_ok:
            self._blocks["read"].inc(num_ok)
            self._bytes["read"].inc(num_ok * self._nbytes)
        if num_ok < len(out):
            self._errors["read"].inc(len(out) - num_ok)
        return out

    def begin_reads_array(self, reads: Any) -> Any:
        out = self._table.begin_reads_array(reads)
        if out is not None:  # None: nothing begun; the caller's `begin_reads` counts each read then
            self._blocks["read"].inc(len(out[1]))
            self._bytes["read"].inc(len(out[1]) * self._nbytes)
        return out

    def end_read(self, *args: Any, **kwargs: Any) -> Any:
        return self._table.end_read(*args, **kwargs)

    def end_reads(self, slots: Any) -> None:
        self._table.end_reads(slots)

    def begin_write(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._table.begin_write(*args, **kwargs)
        except Exception:
            self._errors["write"].inc()
            raise

    def end_write(
        self, slot: int, generation: int, checksum: int, ok: bool, *args: Any, **kwargs: Any
    ) -> None:
        try:
            self._table.end_write(slot, generation, checksum, ok, *args, **kwargs)
        except Exception:
            self._errors["write"].inc()
            raise
        if ok:
            self._blocks["write"].inc()
            self._bytes["write"].inc(self._nbytes)
        else:
            self._errors["write"].inc()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._table, name)
