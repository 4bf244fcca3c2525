"""Registration with the master and heartbeats (standalone when no master is configured)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from kvpool.client.leader import Masters, never_sent, not_leader_redirect
from kvpool.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KVPoolError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvpool.membership import store_proof
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.rpc.server import channel
from kvpool.rpc.status import raise_from_rpc_error
from kvpool.store.slots import SlotTable
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DEREGISTER_TIMEOUT_S = 1.0
"""At most this long on a graceful stop telling the master the node leaves (never blocks shutdown more)."""
MAX_RETRY_S = 1.0
"""Failed heartbeats are retried after 0.1 s, doubling up to this: a master back on its address hears
from the store (which re-registers and re-reports its inventory) within about a second, so the pool's
hits come back within seconds of a master restart. One warning per outage; the retries log at debug."""


class MasterLink:
    """Registers the node with `master_address` and heartbeats every interval from a daemon thread.

    Each heartbeat carries the deferred frees and reclaimed reservations done since the last one
    (`freed_slots`, put back when the heartbeat fails) and the used-slot count. A `known=false` answer
    re-registers. A registration the master refuses for good (layout or protocol mismatch, a node id held
    by a live store, a missing or wrong auth token, a failed membership proof) calls `on_fatal(message)`. With `master_address` empty, `start()` does nothing
    (standalone mode). `master_address` may list masters in high availability ("a:1,b:2"): a call a
    master did not run (a standby naming the leader, or no connection) moves the link to the leader named
    or the next master at once, where a heartbeat answered `known=false` re-registers (the new leader
    adopts the store's inventory). `address` is the master in use.

    `wait_first_answer()` blocks until the first registration attempt is over: accepted, refused (raised),
    or the master could not be reached (a store may start before its master: it keeps retrying).
    """

    def __init__(
        self,
        master_address: str,
        *,
        endpoint: Callable[[], pb.NodeEndpoint],
        layout_fingerprint: str,
        table: SlotTable,
        heartbeat_interval_ms: int = 1000,
        rpc_timeout_s: float = 5.0,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.address = master_address
        self._endpoint = endpoint
        self._layout = layout_fingerprint
        self._table = table
        self.interval_ms = heartbeat_interval_ms
        self._timeout_s = rpc_timeout_s
        self._on_fatal = on_fatal
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = threading.Event()
        self._first_answer = threading.Event()  # the first registration attempt is over (any outcome)
        self.refusal: KVPoolError | None = None  # why the master refused this node for good
        self.master_epoch = 0
        self.num_heartbeats = 0
        self._session = b""  # RegisterNodeResponse.session: our heartbeats carry it

    def start(self) -> None:
        if not self.address:
            log.info("no master configured: standalone store")
            self._first_answer.set()
            return
        self._thread = threading.Thread(target=self._run, name="kvpool-master-link", daemon=True)
        self._thread.start()

    def wait_first_answer(self) -> None:
        """Block until the first registration attempt is over (at most the RPC deadline); raise the master's
        refusal if it refused this node. An unreachable master is not an error here (retried in the
        background)."""
        self._first_answer.wait(self._timeout_s + 1.0)
        if self.refusal is not None:
            raise self.refusal

    def stop(self) -> None:
        """Stop heartbeating, then deregister (a graceful stop: the master drops the node now instead of
        counting it alive until its heartbeat timeout). Best effort: one try of at most
        `DEREGISTER_TIMEOUT_S`; a master that does not answer still sees the heartbeats stop."""
        self._stop.set()
        self._first_answer.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout_s + 1.0)
        if self.registered.is_set():
            self.registered.clear()  # once (stop() may run twice)
            self._deregister()

    def _deregister(self) -> None:
        node = self._endpoint()
        req = pb.DeregisterNodeRequest(node_id=node.node_id, epoch=node.epoch, session=self._session)
        try:
            with channel(self.address) as ch:
                pb_grpc.MasterStub(ch).DeregisterNode(req, timeout=DEREGISTER_TIMEOUT_S)
            log.info("deregistered from master %s", self.address)
        except grpc.RpcError as exc:
            log.warning(
                "could not deregister from master %s (%s): it expires after its heartbeat timeout",
                self.address,
                exc.code() if hasattr(exc, "code") else exc,
            )

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._first_answer.set()

    def _loop(self) -> None:
        masters = Masters(self.address)
        self.address = masters.address
        try:
            self._rounds(masters)
        finally:
            masters.close()

    def _follow(self, masters: Masters, exc: Exception) -> bool:
        """After a call that did not run (a standby's "not the leader (leader is X)", or no connection):
        move to X or the next master of the list; True when it moved (masters in HA, kvpool.master.ha)."""
        if not isinstance(exc, Unavailable):
            return False
        leader = not_leader_redirect(str(exc))
        if leader is None and not never_sent(str(exc)):
            return False
        target = leader if leader and leader != masters.address else masters.next_after(masters.address)
        if not target or target == masters.address:
            return False
        log.warning("master %s: %s; moving to %s", masters.address, exc, target)
        masters.use(target)
        self.address = target
        return True

    def _rounds(self, masters: Masters) -> None:
        backoff_s, moves = 0.1, 0
        failing = False
        while not self._stop.is_set():
            stub = masters.stub
            try:
                if not self.registered.is_set():
                    self._register(stub)
                else:
                    self._heartbeat(stub)
                backoff_s, moves = 0.1, 0
                wait_s = self.interval_ms / 1000
                if failing:
                    log.warning("master %s answers again", self.address)
                    failing = False
            except (
                FailedPrecondition,
                InvalidArgument,
                AlreadyExists,
                Unauthenticated,
                PermissionDenied,
            ) as exc:
                self.refusal = exc
                if self._first_answer.is_set():  # else `wait_first_answer()` raises it to the starter
                    log.error("the master refused this store node: %s", exc)
                if self._on_fatal is not None:
                    self._on_fatal(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - keep trying: the master may come back
                if moves < len(masters.addresses) + 1 and self._follow(masters, exc):
                    moves += 1
                    continue  # at once: the leader (or the next master) may answer
                level = logging.DEBUG if failing else logging.WARNING
                log.log(
                    level,
                    "master %s: %s (retrying every %.1f s at most; quiet until it answers)",
                    *(self.address, exc, MAX_RETRY_S),
                )
                failing = True
                wait_s, backoff_s = backoff_s, min(backoff_s * 2, MAX_RETRY_S)
                moves = 0  # the next round may follow again: a standby elected meanwhile leads now
            self._first_answer.set()
            self._stop.wait(wait_s)

    def _register(self, stub: pb_grpc.MasterStub) -> None:
        node = self._endpoint()
        req = pb.RegisterNodeRequest(
            node=node,
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=self._layout,
            num_slots=self._table.num_slots,
            block_nbytes=self._table.block_nbytes,
        )
        caps = self._table.capabilities
        try:
            if caps is not None:  # prove we hold the cluster secret (kvpool.membership)
                answer = stub.JoinChallenge(
                    pb.JoinChallengeRequest(node_id=node.node_id), timeout=self._timeout_s
                )
                if not answer.challenge:  # refuse before registering: the master never lists this store
                    raise FailedPrecondition(
                        f"this store holds a cluster secret but the master at {self.address} runs "
                        "unsecured (no secret): readers would carry no capabilities; give both the same "
                        "KVPOOL_CLUSTER_SECRET_FILE"
                    )
                req.challenge = answer.challenge
                req.proof = store_proof(
                    caps,
                    answer.challenge,
                    node_id=node.node_id,
                    role=node.role,
                    epoch=node.epoch,
                    grpc_address=node.grpc_address,
                    data_address=node.data_address,
                )
            resp = stub.RegisterNode(req, timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"RegisterNode at {self.address}")
        self._session = resp.session
        if resp.layout_fingerprint and resp.layout_fingerprint != self._layout:
            raise FailedPrecondition(
                f"master layout {resp.layout_fingerprint} != store layout {self._layout}"
            )
        if resp.heartbeat_interval_ms:
            self.interval_ms = int(resp.heartbeat_interval_ms)
        self.master_epoch = resp.master_epoch
        self.registered.set()
        log.info("registered with master %s (master epoch %d)", self.address, resp.master_epoch)

    def _heartbeat(self, stub: pb_grpc.MasterStub) -> None:
        freed = self._table.drain_freed()
        node = self._endpoint()
        req = pb.HeartbeatRequest(
            node_id=node.node_id,
            epoch=node.epoch,
            freed_slots=[pb.SlotRef(slot=s, generation=g) for s, g in freed],
            num_used_slots=self._table.num_used,
            session=self._session,
        )
        try:
            resp = stub.Heartbeat(req, timeout=self._timeout_s)
        except grpc.RpcError as exc:
            self._table.requeue_freed(freed)
            raise_from_rpc_error(exc, f"Heartbeat to {self.address}")
        self.num_heartbeats += 1
        if not resp.known:
            log.warning("master %s does not know this node: re-registering", self.address)
            # the re-registration's inventory covers these frees: resending them could free a slot twice
            self.registered.clear()
