"""A running store node: segment + slot table, the disk tier (`--disk-path`: its slots served beside the
memory ones, tier moves, docs/disk_tier.md), the UCX block server, the gRPC `Store` service, the write-lease
reaper and the master link. `StoreNode(settings).start()` (it returns once the master answered
the first registration, or could not be reached; it raises the master's refusal); `.stop()` ends everything."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.capability import Capabilities, WallClock, process_capabilities
from kvpool.client import MasterClient
from kvpool.client.master_link import HeartbeatReport, MasterLink
from kvpool.errors import KVPoolError, Unauthenticated
from kvpool.membership import MASTER_CALL_METADATA, CallNonces, check_master_call, store_proof
from kvpool.metrics import MetricsServer, address_of, maybe_start
from kvpool.rpc.guards import RequestGuard
from kvpool.rpc.server import GrpcServer, start_server
from kvpool.store.disk_tier import DiskTier, DiskTierError
from kvpool.store.metrics import MeteredHandler, StoreMetrics
from kvpool.store.segment import Segment
from kvpool.store.service import StoreServicer
from kvpool.store.settings import StoreSettings
from kvpool.store.slots import SlotTable
from kvpool.store.tier_moves import TierMoves
from kvpool.types import Clock, NodeInfo
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class StoreNode:
    def __init__(self, settings: StoreSettings, *, clock: Clock | None = None) -> None:
        self.settings = settings
        self.node_id = settings.node_id or f"store-{socket.gethostname()}-{os.getpid()}"
        self.epoch = secrets.randbits(63) or 1
        self.layout = settings.kv_layout
        nbytes = self.layout.block_nbytes  # the disk tier first: a refused path allocates no segment
        self.disk: DiskTier | None = open_disk_tier(settings, settings.segment_bytes // nbytes, nbytes)
        self.segment = Segment(
            settings.segment_bytes,
            self.layout.block_nbytes,
            pin_memory=settings.pin_memory,
            share=settings.share_segment and not settings.metadata_only,
        )
        self.table = SlotTable(
            self.segment,
            clock,
            capabilities=process_capabilities(),
            node_id=self.node_id,
            metadata_only=settings.metadata_only,
            disk=self.disk,
            disk_buffer_bytes=settings.disk_buffer_bytes,
        )
        self.moves: TierMoves | None = None
        if self.disk is not None:
            self.moves = TierMoves(self.table, max_queued_blocks=settings.disk_move_queue_blocks)
            alpha, beta = self.disk.measure()
            log.info("disk tier %s: alpha %.6f s, beta %.3g s/B", self.disk.path, alpha, beta)
        self.metrics = StoreMetrics(self.table, self.moves)
        self._metrics_server: MetricsServer | None = None
        self.host = settings.advertise_host or settings.bind_host
        self._data: Any = None
        self._grpc: GrpcServer | None = None
        self._transport: Any = None
        self._transport_lock = threading.Lock()
        self._stop = threading.Event()
        self.fatal: str | None = None
        self._reaper = threading.Thread(target=self._reap, name="kvpool-store-reaper", daemon=True)
        self.master: MasterLink | None = None  # standalone without a master
        if settings.master:
            self.master = MasterLink(
                MasterClient(settings.master),
                self.node_info,
                layout_fingerprint=self.layout.fingerprint(),
                num_slots=self.table.num_slots,
                block_nbytes=self.table.block_nbytes,
                prove=self._prove if self.table.capabilities is not None else None,
                report=self._report,
                on_unsent=lambda report: self.table.requeue_freed(report.freed_slots),
                on_fatal=self._on_fatal,
                heartbeat_interval_ms=settings.heartbeat_interval_ms,
                on_leader=self.table.fence.observe,
            )

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self._grpc.port if self._grpc else 0}"

    @property
    def data_address(self) -> str:
        return f"{self.host}:{self._data.port if self._data else 0}"

    def endpoint(self) -> pb.NodeEndpoint:
        return pb.NodeEndpoint(
            node_id=self.node_id,
            role="store",
            grpc_address=self.grpc_address,
            data_address=self.data_address,
            epoch=self.epoch,
        )

    def node_info(self) -> NodeInfo:
        """The store as it registers with the master."""
        return NodeInfo(self.node_id, "store", self.grpc_address, self.data_address, self.epoch)

    def _prove(self, node: NodeInfo, challenge: bytes) -> bytes:
        """The membership proof answering the master's join challenge (`kvpool.membership`)."""
        caps = self.table.capabilities
        assert caps is not None  # only asked when the store holds the cluster secret
        return store_proof(
            caps,
            challenge,
            node_id=node.node_id,
            role=node.role,
            epoch=node.epoch,
            grpc_address=node.grpc_address,
            data_address=node.data_address,
        )

    def _report(self) -> HeartbeatReport:
        """A heartbeat's frees since the last one (put back when it fails) and the used-slot count."""
        disk = self.table.disk
        return HeartbeatReport(
            freed_slots=self.table.drain_freed(),
            num_used_slots=self.table.num_used,
            disk=None if disk is None else disk.report(),
        )

    def start(self) -> None:
        from transfer import UcxBlockServer

        self._data = UcxBlockServer(
            MeteredHandler(self.table, self.metrics),
            self.host,
            self.settings.data_port,
            send_timeout_s=self.settings.transfer_timeout_s,
            shared=self.segment.shared,
            slot_state=self.table.shared_state,
        )
        self._data.start()
        servicer = StoreServicer(
            self.table,
            endpoint=self.endpoint,
            layout_fingerprint=self.layout.fingerprint(),
            epoch=self.epoch,
            copy=self.copy_blocks,
            max_batch_slots=self.settings.max_batch_slots,
            inflight=lambda: self.table.num_inflight,
            moves=self.moves,
        )
        self._grpc = start_server(
            [(pb_grpc.add_StoreServicer_to_server, servicer, "kvpool.v1.Store")],
            host=self.settings.bind_host,
            port=self.settings.grpc_port,
            max_workers=self.settings.max_workers,
            max_concurrent_rpcs=self.settings.max_concurrent_rpcs,
            interceptors=master_calls_only(self.table.capabilities, lambda: self.grpc_address),
        )
        s = self.settings
        self._metrics_server = maybe_start(
            self.metrics.registry,
            enabled=s.metrics,
            host=s.bind_host,
            port=s.metrics_port,
            advertise_host=self.host,
        )
        self._reaper.start()
        # Ready only once the master has answered the first registration: a refusal (a layout mismatch, a
        # node id held by a live store) raises here; an unreachable master does not (retried in the
        # background: a pool may start its stores first).
        if self.master is None:
            log.info("no master configured: standalone store")
        else:
            try:
                self.master.start(require_master=False)
            except BaseException:
                self.stop()  # refused: release the ports and threads before the caller hears why
                raise
        log.info("store %s: grpc %s, data %s", self.node_id, self.grpc_address, self.data_address)

    def ready_info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "grpc_address": self.grpc_address,
            "data_address": self.data_address,
            "metrics_address": address_of(self._metrics_server),
            "epoch": self.epoch,
            "num_slots": self.table.num_slots,
            "block_nbytes": self.table.block_nbytes,
            "layout": self.layout.fingerprint(),
            "pid": os.getpid(),
            "metadata_only": self.table.metadata_only,
            "disk": None
            if self.disk is None
            else {
                "path": str(self.disk.path),
                "first_slot": self.disk.first_slot,
                "num_slots": self.disk.num_slots,
                "direct": self.disk.direct,
                "recovered_blocks": self.disk.counters.resident_blocks,
            },
        }

    def wait(self) -> None:
        """Block until `stop()` (or a fatal master refusal)."""
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()
        if self.moves is not None:
            self.moves.close()
            self.moves = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self.master is not None:
            self.master.stop()
            self.master.master.close()
        if self._grpc is not None:
            self._grpc.stop(0.5)
        if self._data is not None:
            self._data.stop()
        if self._metrics_server is not None:
            self._metrics_server.stop()
        if self._transport is not None:
            self._transport.close()

    def request_stop(self) -> None:
        """Ask `wait()` to return (signal-handler safe)."""
        self._stop.set()

    def _on_fatal(self, message: str) -> None:
        self.fatal = message
        self._stop.set()

    def _reap(self) -> None:
        while not self._stop.wait(self.settings.reap_interval_ms / 1000):
            try:
                n = self.table.reap_expired()
                if n:
                    log.info("reclaimed %d reservations whose write lease expired", n)
            except Exception:  # noqa: BLE001 - the reaper never dies
                log.exception("reaper failed")

    def transport(self) -> Any:
        with self._transport_lock:
            if self._transport is None:
                from transfer import UcxTransport

                self._transport = UcxTransport(endpoints_per_peer=self.settings.endpoints_per_peer)
            return self._transport

    def copy_blocks(
        self, src_address: str, blocks: list[tuple[int, int, int, int, int, bytes, int]]
    ) -> list[tuple[int, int, str]]:
        """Pull blocks from the store at `src_address` into reserved slots here (re-replication); each is
        (src slot, src gen, dst slot, dst gen, checksum, src read capability, its expiry ms)."""
        from transfer import BlockRead

        nbytes = self.table.block_nbytes
        errors = [""] * len(blocks)
        began: list[int] = []
        reads, outs = [], []
        for i, (src_slot, src_gen, dst_slot, dst_gen, _, cap, cap_expiry_ms) in enumerate(blocks):
            try:
                outs.append(self.table.begin_copy_write(dst_slot, dst_gen, nbytes))
            except KVPoolError as exc:
                errors[i] = f"{type(exc).__name__}: {exc}"
                continue
            began.append(i)
            reads.append(BlockRead(src_slot, src_gen, nbytes, cap, cap_expiry_ms))
        results = []
        if reads:
            results = self.transport().read_blocks(
                src_address, reads, outs, timeout_s=self.settings.transfer_timeout_s
            )
        for i, res in zip(began, results, strict=True):
            _, _, dst_slot, dst_gen, expected, _, _ = blocks[i]
            try:
                self.table.end_write(dst_slot, dst_gen, expected or res.checksum, res.ok)
            except KVPoolError as exc:
                errors[i] = f"{type(exc).__name__}: {exc}"
                continue
            if not res.ok:
                errors[i] = res.error or "transfer failed"
        return [(b[2], b[3], e) for b, e in zip(blocks, errors, strict=True)]


DISK_FIRST_SLOT = 1 << 31
"""The first disk slot number (above every memory slot; disk slots end below 2**32, the index's slot width)."""


def open_disk_tier(settings: StoreSettings, num_memory_slots: int, block_nbytes: int) -> DiskTier | None:
    """The store's disk tier when `--disk-path` is set (None otherwise). It is opened at start-up, so a bad
    path is refused before the store serves, and served by the slot table (`kvpool.store.disk_serving`).
    Raises `DiskTierError` (one line with the path)."""
    if not settings.disk_path:
        return None
    first = max(DISK_FIRST_SLOT, num_memory_slots)
    tier = DiskTier.open(Path(settings.disk_path), settings.disk_bytes, block_nbytes, first_slot=first)
    if first + tier.num_slots > 1 << 32:
        tier.close()
        raise DiskTierError(
            f"disk tier {settings.disk_path}: {tier.num_slots} slots are more than a store's slot numbers "
            f"hold ({(1 << 32) - first}); use a smaller --disk-size"
        )
    log.info(
        "disk tier %s: %d slots of %d bytes (%s I/O), %d blocks recovered",
        settings.disk_path,
        tier.num_slots,
        tier.slot_nbytes,
        "direct" if tier.direct else "buffered",
        tier.counters.resident_blocks,
    )
    return tier


def master_calls_only(caps: Capabilities | None, address: Callable[[], str]) -> list[RequestGuard]:
    """A secured store serves its control calls (reserve, commit, free, inventory, copy) to the master
    only: each must carry the master's credential for this store (`address()`, its gRPC address), the
    method and the request's bytes (as they came on the wire: `kvpool.rpc.status.DecodeErrors` parses them
    after this guard), made within the skew and never seen here before
    (`kvpool.membership.check_master_call`). `GetInfo` stays open (duplicate-id probes, health of a node's
    identity)."""
    if caps is None:
        return []
    clock = WallClock()
    nonces = CallNonces()

    def check(method: str, metadata: Any, request: Any) -> str | None:
        value = next((v for k, v in metadata if k == MASTER_CALL_METADATA), "")
        try:
            check_master_call(
                caps,
                address(),
                method,
                request if isinstance(request, bytes) else request.SerializeToString(),
                value if isinstance(value, str) else "",
                clock.now_ms(),
                nonces,
                time.monotonic_ns() // 1_000_000,
            )
        except Unauthenticated as exc:
            return str(exc)
        return None

    return [RequestGuard(check, frozenset({"/kvpool.v1.Store/GetInfo"}))]
