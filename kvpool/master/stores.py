"""The master's calls to store nodes' control services (never made under the master's lock), over
`kvpool.client.store_client.StoreClient`: which deadline each order gets, the leader epoch every order carries,
and the master's credential on every call of a secured cluster.

Each call has a deadline; gRPC failures become `kvpool.errors` (`Unavailable`, `FailedPrecondition`...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvpool.capability import Capabilities, WallClock
from kvpool.client.store_client import CallSigner, StoreClient, node_identity
from kvpool.errors import DeadlineExceeded, KVPoolError, Unavailable
from kvpool.master.grants import read_grant
from kvpool.master.store_batch import Coalescer
from kvpool.membership import (
    LEADER_PROOF_METADATA,
    MASTER_CALL_METADATA,
    leader_proof,
    master_call_credential,
)
from kvpool.types import InventoryBatch, Location, SlotOrder

__all__ = ["SlotOrder", "StoreCalls", "copy_into"]

_MAX_COALESCED = 4096
"""Most slots in one coalesced reserve or commit call."""


def _not_the_store(exc: BaseException) -> bool:
    """A combined reserve that failed for another reason than the store (a refused slot) is sent again per
    publish."""
    return not isinstance(exc, (Unavailable, DeadlineExceeded))


_COPY_TIMEOUTS = 2
"""A copy moves blocks between two stores: its deadline is this many call timeouts."""


class StoreCalls:
    """The master's store calls: one channel per store gRPC address, reused; thread-safe. Each call's
    deadline is `timeout_s` seconds (an inventory's, per message; a copy's 2x). With `capabilities` (a secured
    cluster), every call carries the master's credential (`kvpool.membership.master_call_credential`). Every
    order (reserve, commit, free, copy) carries `leader_epoch`: 0 for a single master, else the epoch this
    master won its leadership with (`kvpool.master.ha`, set by `lead`); stores refuse one older than the
    newest they have seen, and a newer one without the leader's proof.

    `leading()` (set with etcd: the election's `is_leader`, a clock comparison) is asked before every order:
    a master that is not surely leading (its lease not renewed in time, or paused past it) sends none, so a
    deposed leader's late orders never leave it (`num_withheld` counts them; each raises `Unavailable`)."""

    def __init__(
        self, timeout_s: float, capabilities: Capabilities | None = None, *, inventory_batch_blocks: int = 0
    ) -> None:
        self.timeout_s = timeout_s
        self.inventory_batch_blocks = inventory_batch_blocks  # per inventory message (0: the store's)
        self.leader_epoch = 0
        self.leader_proof = ""
        """In HA with a cluster secret: `kvpool.membership.leader_proof` of `leader_epoch`, sent with every
        call (a store takes a higher epoch only with it)."""
        self.leading: Callable[[], bool] = lambda: True
        self.num_withheld = 0
        """Orders not sent because this master was not surely leading when it was about to send them."""
        self._client = StoreClient(sign=self._signer(capabilities) if capabilities is not None else None)
        # concurrent publishes' orders to one store go as one call (kvpool.master.store_batch); below the
        # stores' default max_batch_slots (8192)
        self._reserves: Coalescer[SlotOrder, None] = Coalescer(
            self._send_reserve, alone=_not_the_store, max_items=_MAX_COALESCED
        )
        self._commits: Coalescer[Location, dict[tuple[int, int], str]] = Coalescer(
            self._send_commit, max_items=_MAX_COALESCED
        )

    def _may_order(self, what: str, address: str) -> None:
        """Raise `Unavailable` (and count it) unless this master surely leads now."""
        if not self.leading():
            self.num_withheld += 1
            raise Unavailable(f"{what} to store {address} withheld: this master no longer surely leads")

    def lead(self, caps: Capabilities | None, address: str, epoch: int) -> None:
        """Order the stores as the leader at `address` of `epoch` from now on (with its proof)."""
        self.leader_proof = leader_proof(caps, address, epoch) if caps is not None and epoch else ""
        self.leader_epoch = epoch

    def _signer(self, caps: Capabilities) -> CallSigner:
        """The master's credential for each call to a store (`kvpool.membership.master_call_credential`),
        and the leader's proof of its epoch when it has one."""
        clock = WallClock()

        def sign(address: str, method: str, body: bytes) -> list[tuple[str, str]]:
            cred = master_call_credential(caps, address, method, body, clock.now_ms())
            proof = self.leader_proof
            pairs = [(MASTER_CALL_METADATA, cred)]
            return [*pairs, (LEADER_PROOF_METADATA, proof)] if proof else pairs

        return sign

    def forget(self, address: str) -> None:
        self._client.forget(address)

    def close(self) -> None:
        self._client.close()

    def identity(self, address: str, timeout_s: float, *, role: str = "store") -> tuple[str, int] | None:
        """(node_id, epoch) of the `role` node answering `GetInfo` at `address` (its Store, Prefill or Decode
        service), or None when none answers in time (or it is an older build without that method)."""
        if role == "store":
            info = self._client.get_info(address, timeout_s=timeout_s)
        else:  # a one-off probe: the master keeps no channel to serving nodes
            info = node_identity(address, role, timeout_s=timeout_s)
        return None if info is None else (info.node_id, info.epoch)

    def reserve(self, address: str, orders: Sequence[SlotOrder], write_lease_ms: int) -> None:
        """Reserve slots (all or none), coalesced with concurrent reserves on the same store."""
        self._reserves.call((address, write_lease_ms), orders)

    def _send_reserve(self, key: Any, orders: list[SlotOrder]) -> None:
        address, write_lease_ms = key
        self._may_order("reserve", address)
        self._client.reserve_slots(
            address,
            orders,
            write_lease_ms=write_lease_ms,
            leader_epoch=self.leader_epoch,
            timeout_s=self.timeout_s,
        )

    def commit(self, address: str, slots: Sequence[Location]) -> dict[tuple[int, int], str]:
        """Commit slots; returns {(slot, generation): error} for the ones that failed ("" = ok) (it may name
        slots of concurrent commits on the same store too: coalesced)."""
        return self._commits.call(address, slots)

    def _send_commit(self, address: Any, slots: list[Location]) -> dict[tuple[int, int], str]:
        self._may_order("commit", address)
        return self._client.commit_slots(
            address, slots, leader_epoch=self.leader_epoch, timeout_s=self.timeout_s
        )

    @property
    def coalesced_calls(self) -> tuple[int, int]:
        """(reserve and commit calls sent, of which carried several publishes' orders)."""
        return (
            self._reserves.calls + self._commits.calls,
            self._reserves.batched_calls + self._commits.batched_calls,
        )

    def free(self, address: str, slots: Sequence[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        """Order slots freed; returns (slot, new_generation, deferred) per slot the store answered."""
        self._may_order("free", address)
        return self._client.free_slots(
            address, slots, leader_epoch=self.leader_epoch, timeout_s=self.timeout_s
        )

    def inventory(self, address: str, *, after_slot: int = 0) -> Iterator[InventoryBatch]:
        """The store's committed blocks in slots >= `after_slot`, one batch per message, each message
        within `timeout_s` (`kvpool.client.store_client.StoreClient.inventory`)."""
        return self._client.inventory(
            address,
            after_slot=after_slot,
            message_timeout_s=self.timeout_s,
            max_entries=self.inventory_batch_blocks,
        )

    def copy(
        self, address: str, src_data_address: str, blocks: Sequence[tuple[Location, Location, int]]
    ) -> dict[tuple[int, int], str]:
        """Have the store at `address` pull (src, dst, checksum) blocks (with the read capability `src`
        carries); {(dst slot, gen): error}."""
        self._may_order("copy", address)
        return self._client.copy_blocks(
            address,
            src_data_address,
            blocks,
            leader_epoch=self.leader_epoch,
            timeout_s=self.timeout_s * _COPY_TIMEOUTS,
        )


def copy_into(
    stores: StoreCalls,
    caps: Capabilities | None,
    address: str,
    src_data_address: str,
    key: tuple[bytes, bytes],
    parent: bytes,
    src: Location,
    dst: Location,
    checksum: int,
    write_lease_ms: int,
    epoch: int = 0,
) -> str:
    """Copy block `key` (namespace, hash; `parent` its parent hash) from replica `src` (on the store at
    `src_data_address`) into slot `dst` of the store at `address`: reserve `dst`, have that store pull `src`
    with a read capability granted for `write_lease_ms` (bound to the leader `epoch`), commit. "" on success, else the error
    ("ChecksumMismatch: ...", "Unavailable: ...", a store's refusal). Outside the master's lock."""
    ns, h = key
    ref = (dst.slot, dst.generation)
    try:
        stores.reserve(address, [SlotOrder(dst.slot, dst.generation, ns, h, parent)], write_lease_ms)
        grant = read_grant(caps, ns, h, src, write_lease_ms, epoch)
        err = stores.copy(address, src_data_address, [(grant, dst, checksum)]).get(ref, "")
        if not err:
            err = stores.commit(address, [dst]).get(ref, "")
    except KVPoolError as exc:
        err = f"{type(exc).__name__}: {exc}"
    return err
