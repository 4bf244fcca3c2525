"""A process's membership of the pool: registration with the master, heartbeats, deregistration.

One `MasterLink` serves every role that joins the pool (store nodes, prefill and decode nodes, vLLM
engines); what differs by role comes in as values and callables: a store's slots and membership proof and
the frees its heartbeats carry, a serving node's load, the namespaces a node uses (`link.namespaces`).

When the master answers a heartbeat with `known=false` (it restarted, a new leader took over, or it
declared the node dead) the link registers the node again at once, then every namespace it uses, so the
master's soft state comes back (DESIGN: "a master restarted from nothing rebuilds its index from the store
nodes' inventories and the nodes' re-registered namespaces"). Following the leader among several masters
("a:1,b:2") is the `MasterClient`'s.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.client.master_client import MasterClient
from kvpool.client.namespaces import NamespaceRegistry
from kvpool.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.types import DiskTierReport, NodeInfo, NodeLoad

log = logging.getLogger(__name__)

REFUSALS = (AlreadyExists, FailedPrecondition, InvalidArgument, PermissionDenied, Unauthenticated)
"""A registration the master refuses for good (a live node holds the node id, a layout or protocol
mismatch, a missing or wrong auth token, a failed membership proof): retrying cannot help."""
HEARTBEAT_REFUSALS = (PermissionDenied, Unauthenticated)
"""A heartbeat the master refuses for good (its join token was revoked, a wrong session)."""
DEREGISTER_TIMEOUT_S = 1.0
"""At most this long on a graceful stop telling the master the node leaves (never blocks shutdown more)."""
FIRST_RETRY_S = 0.1
MAX_RETRY_S = 1.0
"""A failed heartbeat or registration is retried after `FIRST_RETRY_S`, doubling up to this: a master back
on its address hears from the node (which registers again) within about a second, so the pool's hits come
back within seconds of a master restart. One warning per outage; the retries log at debug."""


def new_epoch() -> int:
    """A random process epoch in [1, 2**63): a node's registrations under a new epoch replace the old."""
    return secrets.randbits(63) or 1


@dataclass(frozen=True, slots=True)
class HeartbeatReport:
    """What one heartbeat carries besides the node's identity: a store's frees since the last heartbeat
    ((slot, generation) pairs) and its used-slot count, a serving node's load."""

    freed_slots: Sequence[tuple[int, int]] = ()
    num_used_slots: int = 0
    load: NodeLoad | None = None
    disk: DiskTierReport | None = None  # a store's disk tier (docs/disk_tier.md)


class MasterLink:
    """Registers `node` with the master through `master` and heartbeats from a daemon thread.

    `node`: the node's identity (a `NodeInfo`, or a callable answering it: a store's ports are known once
    its servers started). A store offers `num_slots` blocks of `block_nbytes`; `prove(node, challenge)`
    answers the master's join challenge (a store holding the cluster secret). `report()` gives each
    heartbeat's `HeartbeatReport` (settable attribute); `on_unsent(report)` gets back one whose heartbeat
    failed (a store requeues its frees). `on_heartbeat(epoch)` runs after each successful round (e.g. to
    flush local-tier events); `on_reconnect()` after the first successful one of an outage or a
    registration anew (e.g. to probe the pool); `on_flush_epoch(n)` with each answer's flush epoch (it
    moves when a namespace is invalidated); `on_leader(epoch, proof)` with each registration's and
    heartbeat's leader epoch and proof (a store raises its fence: `kvpool.store.fence`). A registration refused for good (`REFUSALS`) or a heartbeat
    refused for good (`HEARTBEAT_REFUSALS`) stops the link and calls `on_fatal(message)`; `refusal` holds
    it. Failed rounds are retried with a backoff up to `MAX_RETRY_S`.
    """

    def __init__(
        self,
        master: MasterClient,
        node: NodeInfo | Callable[[], NodeInfo],
        *,
        layout_fingerprint: str,
        num_slots: int = 0,
        block_nbytes: int = 0,
        prove: Callable[[NodeInfo, bytes], bytes] | None = None,
        report: Callable[[], HeartbeatReport] | None = None,
        on_unsent: Callable[[HeartbeatReport], None] | None = None,
        on_heartbeat: Callable[[int], None] | None = None,
        on_reconnect: Callable[[], None] | None = None,
        on_flush_epoch: Callable[[int], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        heartbeat_interval_ms: int = 1000,
        on_leader: Callable[[int, str], object] | None = None,
    ) -> None:
        self.master = master
        self._node = node
        self.layout_fingerprint = layout_fingerprint
        self.num_slots = num_slots
        self.block_nbytes = block_nbytes
        self.prove = prove
        self.report = report
        self.on_unsent = on_unsent
        self.on_heartbeat = on_heartbeat
        self.on_reconnect = on_reconnect
        self.on_flush_epoch = on_flush_epoch
        self.on_fatal = on_fatal
        self.on_leader = on_leader
        self.heartbeat_interval_s = heartbeat_interval_ms / 1000.0
        self.namespaces = NamespaceRegistry(master)
        self.refusal: Exception | None = None  # why the master refused this node for good
        self.master_epoch = 0
        self.num_heartbeats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered = False  # the master accepted this epoch once: deregister on stop
        self._to_register = True  # the next round registers (again), namespaces included

    @property
    def node(self) -> NodeInfo:
        """The node as it registers (its addresses and epoch)."""
        return self._node() if callable(self._node) else self._node

    @property
    def address(self) -> str:
        """The master in use ("host:port")."""
        return self.master.address

    @property
    def registered(self) -> bool:
        """The master accepted the node's current registration (until it forgets it or the link stops)."""
        return self._registered and not self._to_register

    def start(self, *, require_master: bool = True) -> None:
        """Register, then heartbeat in a thread. Raises the master's refusal (`REFUSALS`) of the first
        registration; an unreachable master raises too, unless `require_master` is False: then the link
        keeps trying and registers when the master first answers (a store or an engine may start first)."""
        try:
            self._register()
        except REFUSALS as exc:
            self.refusal = exc
            raise
        except Exception as exc:
            if require_master:
                raise
            log.warning(
                "master %s unreachable (%s): %s starts without it and registers when it answers",
                *(self.address, exc, self.node.node_id),
            )
        self._thread = threading.Thread(
            target=self._run, name=f"master-link-{self.node.node_id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop heartbeating, then deregister once (a graceful stop: the master, and so the router, drop
        the node now instead of after its heartbeat timeout). Best effort: one try of at most
        `DEREGISTER_TIMEOUT_S`; a master that does not answer still sees the heartbeats stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.master.timeout_s + 1.0)
        if self._registered:
            self._registered = False  # once (stop() may run twice)
            node = self.node
            try:
                self.master.deregister_node(node.node_id, node.epoch, timeout_s=DEREGISTER_TIMEOUT_S)
                log.info("%s deregistered from master %s", node.node_id, self.address)
            except Exception as exc:  # noqa: BLE001 - never block shutdown; it expires instead
                log.warning(
                    "could not deregister %s from master %s (%s): it expires after its heartbeat timeout",
                    *(node.node_id, self.address, exc),
                )

    def _register(self) -> None:
        """Register the node, then every namespace it uses (raises the master's error)."""
        node = self.node
        challenge = proof = b""
        if self.prove is not None:  # prove we hold the cluster secret (kvpool.membership)
            challenge = self.master.join_challenge(node.node_id)
            if not challenge:  # refuse before registering: the master never lists this node
                raise FailedPrecondition(
                    f"this {node.role} node holds a cluster secret but the master at {self.address} runs "
                    "unsecured (no secret): readers would carry no capabilities; give both the same "
                    "KVPOOL_CLUSTER_SECRET_FILE"
                )
            proof = self.prove(node, challenge)
        reg = self.master.register_node(
            node,
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=self.layout_fingerprint,
            num_slots=self.num_slots,
            block_nbytes=self.block_nbytes,
            challenge=challenge,
            proof=proof,
        )
        self._registered = True
        if self.on_leader is not None:
            self.on_leader(reg.leader_epoch, reg.leader_proof)
        if reg.layout_fingerprint and reg.layout_fingerprint != self.layout_fingerprint:
            raise FailedPrecondition(
                f"master layout {reg.layout_fingerprint} != {node.role} layout {self.layout_fingerprint}"
            )
        if reg.heartbeat_interval_ms:
            self.heartbeat_interval_s = reg.heartbeat_interval_ms / 1000.0
        self.master_epoch = reg.master_epoch
        log.info(
            "%s registered with master %s (master epoch %d)", node.node_id, self.address, reg.master_epoch
        )
        self.namespaces.register_all()
        self._to_register = False

    def _heartbeat(self) -> bool:
        """One heartbeat; a master that does not know the node has it register again at once (True)."""
        node = self.node
        report = self.report() if self.report is not None else HeartbeatReport()
        try:
            answer = self.master.heartbeat(
                node.node_id,
                node.epoch,
                freed_slots=report.freed_slots,
                num_used_slots=report.num_used_slots,
                load=report.load,
                disk=report.disk,
            )
        except Exception:
            if self.on_unsent is not None:
                self.on_unsent(report)
            raise
        self.num_heartbeats += 1
        if self.on_leader is not None:
            self.on_leader(answer.leader_epoch, answer.leader_proof)
        if self.on_flush_epoch is not None:
            self.on_flush_epoch(answer.flush_epoch)
        if not answer.known:
            log.warning(
                "master %s does not know %s (restarted?): registering again", self.address, node.node_id
            )
            # the registration's inventory covers the frees just sent: resending them could free a slot twice
            self._to_register = True
            self._register()
            return True
        return False

    def _run(self) -> None:
        backoff_s, failing = FIRST_RETRY_S, False
        wait_s = FIRST_RETRY_S if self._to_register else self.heartbeat_interval_s  # not yet registered: soon
        while not self._stop.wait(wait_s):
            try:
                anew = self._to_register
                if anew:
                    self._register()
                else:
                    anew = self._heartbeat()
                if self.on_heartbeat is not None:
                    self.on_heartbeat(self.node.epoch)
                if (failing or anew) and self.on_reconnect is not None:
                    self.on_reconnect()
                if failing:
                    log.warning("master %s answers %s again", self.address, self.node.node_id)
                    failing = False
                backoff_s, wait_s = FIRST_RETRY_S, self.heartbeat_interval_s
            except Exception as exc:  # noqa: BLE001 - keep trying (the master may come back) unless refused
                if isinstance(exc, REFUSALS if self._to_register else HEARTBEAT_REFUSALS):
                    self._fatal(exc)
                    return
                log.log(
                    logging.DEBUG if failing else logging.WARNING,
                    "master %s: %s (%s retries every %.1f s at most; quiet until it answers)",
                    *(self.address, exc, self.node.node_id, MAX_RETRY_S),
                )
                failing = True
                wait_s, backoff_s = backoff_s, min(backoff_s * 2, MAX_RETRY_S)

    def _fatal(self, exc: Exception) -> None:
        self.refusal = exc
        self._registered = False
        node = self.node
        log.error("the master refused %s node %s: %s", node.role, node.node_id, exc)
        if self.on_fatal is not None:
            self.on_fatal(f"{type(exc).__name__}: {exc}")
