"""The master's node registry: registration (with membership, `kvpool.master.members`), heartbeats,
deregistration and reachability. A mixin of `Master` (`kvpool.master.core`): it uses the master's lock,
state, clock, settings, store calls and membership, and calls `Master._forget_node`.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from kvpool.master.nodes import NodeRecord
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.types import NodeLoad

if TYPE_CHECKING:
    from kvpool.master.core import MasterState
    from kvpool.master.members import Membership
    from kvpool.master.settings import MasterSettings
    from kvpool.master.stores import StoreCalls
    from kvpool.types import Clock, KVLayout

log = logging.getLogger("kvpool.master.core")

ROLES = ("store", "prefill", "decode", "router", "vllm", "vllm-prefill", "vllm-decode")
"""`vllm*`: a vLLM engine through kvpool's connector (prefill and decode, or one of them)."""
DUPLICATE_PROBE_TIMEOUT_S = 1.0
"""How long a registration waits for the node that already holds its node id to answer."""
PROBED_ROLES = ("store", "prefill", "decode")
"""Roles that serve `GetInfo`: a live one keeps its node id against a second process claiming it."""


class NodeRegistry:
    """Node methods of `Master`; every public method validates its input and raises `kvpool.errors`."""

    settings: MasterSettings
    layout: KVLayout
    clock: Clock
    lock: threading.RLock
    st: MasterState
    stores: StoreCalls
    members: Membership
    wake: threading.Event

    def _forget_node(self, rec: NodeRecord) -> None:
        raise NotImplementedError  # Master's

    def register_node(
        self,
        *,
        node_id: str,
        role: str,
        grpc_address: str,
        data_address: str,
        epoch: int,
        protocol_version: int,
        layout_fingerprint: str,
        num_slots: int,
        block_nbytes: int,
        session: bytes = b"",
        join_token: str = "",
        url: str = "",
        engine_namespace: tuple[str, ...] = (),
    ) -> None:
        """Add or refresh a node. A new epoch replaces everything the node had (B22). The caller admitted
        it (`Membership`): `session` is what its heartbeats must carry, `join_token` the name of the token
        it joined with ("" for a store or an unsecured cluster). Raises `PermissionDenied` when a live
        node holds `node_id` under another active join token (a member never takes another's node id)."""
        if not node_id:
            raise InvalidArgument("node_id must be non-empty")
        if role not in ROLES:
            raise InvalidArgument(f"role must be one of {ROLES}, got {role!r}")
        if protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(f"protocol version {protocol_version} != master's {PROTOCOL_VERSION}")
        if layout_fingerprint != self.layout.fingerprint():
            raise FailedPrecondition(
                f"layout {layout_fingerprint!r} does not match the pool's {self.layout.fingerprint()!r}"
            )
        if role == "store":
            if not 0 < num_slots <= 1 << 32:
                raise InvalidArgument(f"a store node needs 0 < num_slots <= 2**32, got {num_slots}")
            if block_nbytes != self.layout.block_nbytes:
                raise FailedPrecondition(
                    f"block_nbytes {block_nbytes} != layout's {self.layout.block_nbytes}"
                )
            if not data_address:
                raise InvalidArgument("a store node needs a data_address")
        if role in PROBED_ROLES:
            self._refuse_live_duplicate(node_id, role, epoch, grpc_address)
        with self.lock:
            old = self.st.nodes.get(node_id)
            if (
                old is not None
                and old.alive
                and old.join_token != join_token
                and self._active(old.join_token)
            ):
                raise PermissionDenied(
                    f"node id {node_id!r} is held by a live node that joined with another join token: a "
                    "member registers only as itself"
                )
            now = self.clock.now_ms()
            if old is not None and old.epoch == epoch and old.alive and old.role == role:
                old.grpc_address, old.data_address, old.last_seen_ms = grpc_address, data_address, now
                old.session, old.join_token, old.url = session, join_token, url
                old.engine_namespace = engine_namespace
                return
            if old is not None:
                log.info("node %s re-registers (epoch %d -> %d)", node_id, old.epoch, epoch)
                self._forget_node(old)
            rec = NodeRecord(node_id, role, grpc_address, data_address, epoch, num_slots, block_nbytes, now)
            rec.ready = role != "store"
            rec.registered_ms = now
            rec.session, rec.join_token, rec.url = session, join_token, url
            rec.engine_namespace = engine_namespace
            self.st.nodes[node_id] = rec
            if role == "store":
                self.st.to_adopt.add(node_id)
                self.wake.set()
            log.info("node %s (%s) registered, epoch %d", node_id, role, epoch)

    def _active(self, token_name: str) -> bool:
        """Whether join token `token_name` is still active ("" for a store or an unsecured cluster: yes)."""
        try:
            self.members.check_still_active(token_name)
        except PermissionDenied:
            return False
        return True

    def _refuse_live_duplicate(self, node_id: str, role: str, epoch: int, grpc_address: str) -> None:
        """Raise `AlreadyExists` when another live node holds `node_id`: two stores (or prefill, or decode
        nodes) started with one `--node-id` replaced each other's registration on every heartbeat. A
        registration under a new epoch is a restart unless the registered node still answers `GetInfo` at
        its address with its own id and epoch (asked outside the lock; a dead, frozen or replaced process
        does not)."""
        with self.lock:
            old = self.st.nodes.get(node_id)
            if (
                old is None
                or not old.alive
                or old.role not in PROBED_ROLES
                or old.epoch == epoch
                or old.grpc_address == grpc_address  # its port is ours now: that process is gone
            ):
                return
            address, old_epoch, old_role = old.grpc_address, old.epoch, old.role
        if self.stores.identity(address, DUPLICATE_PROBE_TIMEOUT_S, role=old_role) == (node_id, old_epoch):
            raise AlreadyExists(
                f"node id {node_id!r} is held by a live {old_role} at {address}: "
                "give every node its own --node-id"
            )

    def heartbeat(
        self,
        node_id: str,
        epoch: int,
        freed_slots: Sequence[tuple[int, int]],
        num_used_slots: int,
        load: NodeLoad,
    ) -> bool:
        """Returns False ("re-register") for an unknown node, an old epoch, or a node declared dead."""
        with self.lock:
            rec = self.st.nodes.get(node_id)
            if rec is None or rec.epoch != epoch or not rec.alive:
                return False
            rec.last_seen_ms = self.clock.now_ms()
            rec.num_used_slots_reported = num_used_slots
            rec.load = load
            for slot, gen in freed_slots:
                if rec.free.is_pending(slot):
                    rec.give_back(slot, gen)
            return True

    def check_session(self, node_id: str, epoch: int, session: bytes) -> None:
        """A secured master's check of a heartbeat or deregistration: it carries the session of the node's
        registration (else `Unauthenticated`), and the join token the node joined with is still active
        (else the node is forgotten now and `PermissionDenied` says why). An unknown node passes (the
        caller answers "re-register")."""
        rec = self.st.nodes.get(node_id)
        if not self.members.secured or rec is None or rec.epoch != epoch or not rec.alive:
            return
        if not hmac.compare_digest(rec.session, session):
            raise Unauthenticated(f"node {node_id!r}: missing or wrong registration session")
        try:
            self.members.check_still_active(rec.join_token)
        except PermissionDenied as exc:
            with self.lock:
                if self.st.nodes.get(node_id) is rec and rec.alive:
                    log.warning("node %s (%s) removed: %s", node_id, rec.role, exc)
                    self._forget_node(rec)
            self.wake.set()
            raise

    def deregister_node(self, node_id: str, epoch: int) -> bool:
        """A node stopping on purpose: dead now rather than after its heartbeat timeout (a store's replicas
        leave the index, blocks with other replicas get re-copied). False when no live node has that id and
        epoch (already gone, or restarted under a new epoch: an old process never removes its successor)."""
        with self.lock:
            rec = self.st.nodes.get(node_id)
            if rec is None or rec.epoch != epoch or not rec.alive:
                return False
            log.info("node %s (%s) deregistered: it is stopping", node_id, rec.role)
            self._forget_node(rec)
        self.wake.set()  # re-replicate what it held now
        return True

    def reachable(self, rec: NodeRecord) -> bool:
        """Under the lock: worth sending new work to now (`NodeRecord.reachable`)."""
        s = self.settings
        return rec.reachable(self.clock.now_ms(), min(s.stale_after_ms, s.heartbeat_timeout_ms))

    def mark_unreachable(self, node_id: str, why: object) -> None:
        """A control call to a store failed: no placements or free orders to it for a back-off."""
        with self.lock:
            rec = self.st.nodes.get(node_id)
            if rec is not None:
                rec.unreachable_until_ms = self.clock.now_ms() + self.settings.unreachable_backoff_ms
        log.warning(
            "store %s unreachable, backing off %d ms: %s", node_id, self.settings.unreachable_backoff_ms, why
        )

    def node(self, node_id: str) -> NodeRecord:
        rec = self.st.nodes.get(node_id)
        if rec is None:
            raise NotFound(f"unknown node {node_id!r}")
        return rec
