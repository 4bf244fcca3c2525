"""Leader election of masters through etcd (the `aetcd` asyncio client, on a thread of its own).

Every master started with etcd endpoints holds one etcd lease of `lease_ttl_s` seconds, kept alive every
`lease_ttl_s / 3`, and puts `<prefix>/members/<address>` under it (the standby list). It campaigns with one
transaction: "if `<prefix>/leader` does not exist, put my address there under my lease". The winner leads;
its **epoch** is that key's create revision, so a later leader always has a higher epoch (etcd revisions
only grow). The others stand by, watching the key, and campaign again as soon as it goes away (its lease
expired or was revoked).

A leader steps down on its own at `last keep-alive sent + lease_ttl_s - step_down_margin_s` when no
keep-alive succeeded since (before etcd can expire its key), and at once when a keep-alive answers the lease
gone or the key holds someone else: it becomes `deposed` (stops taking writes, see `kvpool.master.ha.gate`)
until it reaches etcd again, where it stands by or wins a new, higher epoch. A master stopping cleanly
revokes its lease: the standbys take over within a watch round trip, not a TTL.

With the cluster secret, what a master puts at the leader key is a claim MAC'd under it
(`kvpool.membership.leader_claim`): a key anyone else wrote names no leader (see `Election`). etcd is
reached as `EtcdAuth` says (user and password, TLS: `kvpool.master.ha.etcd_client`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aetcd

from kvpool.capability import Capabilities
from kvpool.master.ha.endpoints import EtcdAuth, parse_endpoints
from kvpool.master.ha.etcd_client import EtcdClient
from kvpool.membership import leader_claim, read_leader_claim
from kvpool.rpc.loop import new_event_loop

__all__ = ["DEPOSED", "LEADER", "STANDBY", "Election", "HaView", "parse_endpoints"]

log = logging.getLogger(__name__)

LEADER = "leader"
STANDBY = "standby"
DEPOSED = "deposed"  # was leader, lost its lease (or etcd): takes no writes until it hears from etcd again


@dataclass(frozen=True, slots=True)
class HaView:
    """What one master knows of the election. `leader` is "" and `epoch` 0 while unknown."""

    role: str  # LEADER | STANDBY | DEPOSED
    address: str  # this master's advertised gRPC address
    leader: str
    epoch: int  # the leader's epoch (its key's etcd create revision)
    standbys: tuple[str, ...]  # the live masters but the leader (members with a live lease), sorted
    endpoints: tuple[str, ...]  # etcd endpoints, "host:port"
    elections: int  # times this master won an election
    failovers: int  # leader changes this master saw (a new leader after another one)


class Election:
    """Campaigns for `<prefix>/leader` as `address` once `start()` is called; `view()` is thread-safe.

    `on_lead(epoch)` runs (on the election thread) after a win and before `role` turns LEADER, so what it
    sets (the epoch of store orders) is in place before any write is taken. `lease_ttl_s` is etcd's integer
    TTL in seconds (>= 2); `op_timeout_s` bounds each etcd call; `etcd_auth`: etcd's user, password and TLS.

    With `key` (the cluster secret), the leader key holds a MAC over the address and the lease
    (`kvpool.membership.leader_claim`): a key that does not carry one (written by anyone without the secret)
    names no leader. A leader whose key is replaced so deletes it and campaigns again, leading on without
    a break (at a new epoch); a standby ignores it, and deletes it after a lease TTL (no leader to do so).
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        prefix: str = "/kvpool/master",
        lease_ttl_s: int = 5,
        op_timeout_s: float = 1.0,
        on_lead: Callable[[int], None] | None = None,
        key: Capabilities | None = None,
        etcd_auth: EtcdAuth | None = None,
    ) -> None:
        if lease_ttl_s < 2:
            raise ValueError(f"lease_ttl_s must be >= 2, got {lease_ttl_s}")
        self._endpoints = tuple(endpoints)
        self._prefix = prefix.rstrip("/")
        self.lease_ttl_s = lease_ttl_s
        self._op_s = op_timeout_s
        self._margin_s = max(0.5, lease_ttl_s * 0.2)
        self._on_lead = on_lead
        self._key = key
        self._auth = etcd_auth or EtcdAuth()
        self.continued = False
        """During `on_lead`: this master led until this new epoch, with no other leader between (its key
        was replaced by a forged one, which it deleted)."""
        self._forged: tuple[int, float] = (0, 0.0)  # (mod revision, monotonic s first seen) of a forged key
        self.num_forged = 0
        """Leader keys seen that no master wrote (no valid claim)."""
        self._lock = threading.Lock()
        self._address = ""
        self._role = STANDBY
        self._leader = ""
        self._last_leader = ""  # the last leader known (failovers count changes of it)
        self._epoch = 0
        self._members: tuple[str, ...] = ()
        self._elections = 0
        self._failovers = 0
        self._loop = new_event_loop()
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._watch_from: int | None = None
        self._lease_id = 0  # kept across connections (any endpoint can keep it alive) until it lapses
        self._deadline = 0.0  # monotonic s: etcd keeps the lease at least until then

    @property
    def address(self) -> str:
        """This master's advertised address ("" before `start`)."""
        return self._address

    @property
    def leader_key(self) -> bytes:
        return f"{self._prefix}/leader".encode()

    @property
    def members_prefix(self) -> bytes:
        return f"{self._prefix}/members/".encode()

    @property
    def role(self) -> str:
        """LEADER only while the lease is surely alive at etcd: checked against the clock at each read, so
        a leader whose election thread stalls (no keep-alive) reads DEPOSED in time all the same."""
        role = self._role
        if role == LEADER and time.monotonic() >= self._deadline - self._margin_s:
            return DEPOSED
        return role

    @property
    def is_leader(self) -> bool:
        return self.role == LEADER

    @property
    def leader(self) -> str:
        """The leader's address; "" while unknown (a deposed leader knows none until etcd answers)."""
        return "" if self.role == DEPOSED else self._leader

    def view(self) -> HaView:
        with self._lock:
            role = self.role
            return HaView(
                role=role,
                address=self._address,
                leader="" if role == DEPOSED else self._leader,
                epoch=self._epoch,
                standbys=tuple(m for m in self._members if m != self._leader or role == DEPOSED),
                endpoints=tuple(f"{h}:{p}" for h, p in self._endpoints),
                elections=self._elections,
                failovers=self._failovers,
            )

    def start(self, address: str) -> None:
        """Begin campaigning as `address` (the master's advertised "host:port"); returns at once."""
        self._address = address
        self._thread = threading.Thread(target=self._thread_main, name="kvpool-ha-election", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 3.0) -> None:
        """Stand down: revoke the lease (a standby takes over at once) and end the thread."""
        if self._thread is None:
            return
        stop = self._stop
        if stop is not None:
            self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout_s)
        self._thread = None

    # ---------------------------------------------------------------- the election thread

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    def _set(self, **fields: object) -> None:
        with self._lock:
            leader = fields.get("leader")
            if isinstance(leader, str) and leader:
                if self._last_leader and leader != self._last_leader:
                    self._failovers += 1
                self._last_leader = leader
            for name, value in fields.items():
                setattr(self, "_" + name, value)

    def _step_down(self, why: str) -> None:
        if self._role == LEADER:
            log.warning("master %s steps down (epoch %d): %s", self._address, self._epoch, why)
            self._set(role=DEPOSED)

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        watchdog = asyncio.create_task(self._watchdog())
        turn = 0
        while not self._stop.is_set():
            host, port = self._endpoints[turn % len(self._endpoints)]
            turn += 1
            client = EtcdClient(host, port, self._auth, self._op_s)
            try:
                await self._session(client)
            except Exception as exc:  # noqa: BLE001 - etcd unreachable or the lease lost: retry
                log.info("election on etcd %s:%d: %s: %s", host, port, type(exc).__name__, exc)
            finally:
                if self._stop.is_set():
                    self._step_down("stopping")
                    if self._lease_id:
                        with contextlib.suppress(Exception):  # it expires on its own
                            await asyncio.wait_for(client.revoke_lease(self._lease_id), self._op_s)
                with contextlib.suppress(Exception):  # closing a dead channel
                    await asyncio.wait_for(client.close(), self._op_s)
            if not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.2)
        watchdog.cancel()

    async def _keep_alive(self, client: aetcd.Client) -> None:
        """Refresh the current lease, or grant a new one when there is none or it lapsed."""
        sent = time.monotonic()
        if self._lease_id and sent < self._deadline:
            reply = await client.refresh_lease(self._lease_id)
            if reply is not None and reply.TTL > 0:
                self._deadline = sent + reply.TTL
                return
            self._step_down("the lease expired")
        lease = await client.lease(self.lease_ttl_s)
        self._lease_id, self._deadline = lease.id, sent + lease.ttl

    async def _session(self, client: aetcd.Client) -> None:
        """One connection's life: keep-alive, member key, campaign/lead/watch rounds until a call fails."""
        assert self._stop is not None
        address = self._address.encode()
        while not self._stop.is_set():
            lease_id = self._lease_id
            await self._keep_alive(client)
            if self._lease_id != lease_id:
                await client.put(self.members_prefix + address, address, lease=self._lease_id)
            await self._campaign(client, self._lease_id)
            members = await client.get_prefix(self.members_prefix)
            self._set(members=tuple(sorted(kv.value.decode() for kv in members)))
            await self._wait_round(client)

    async def _watchdog(self) -> None:
        """Steps a leader down `_margin_s` before its lease may expire at etcd, whatever etcd answers."""
        while True:
            if self._role == LEADER and time.monotonic() >= self._deadline - self._margin_s:
                self._step_down(f"no keep-alive answered within {self.lease_ttl_s} s")
            await asyncio.sleep(0.05)

    async def _campaign(self, client: aetcd.Client, lease_id: int, *, again: bool = True) -> None:
        key, me = self.leader_key, self._address
        tx = client.transactions
        won, responses = await client.transaction(
            compare=[tx.create(key) == 0],
            success=[tx.put(key, leader_claim(self._key, me, lease_id), lease_id)],
            failure=[tx.get(key)],
        )
        current = (
            await client.get(key) if won else (responses[0][0][1] if responses and responses[0] else None)
        )
        if current is None:
            return  # gone between the two: the next round campaigns again
        named = read_leader_claim(self._key, current.value, current.lease)
        if named is None:
            if await self._forged_key(client, current) and again:
                await self._campaign(client, lease_id, again=False)
            return
        if named == me and current.lease == lease_id:
            if self._role != LEADER or self._epoch != current.create_revision:
                epoch = current.create_revision
                self.continued = self.role == LEADER
                if self._on_lead is not None:
                    self._on_lead(epoch)
                self.continued = False
                if epoch != self._epoch:
                    with self._lock:
                        self._elections += 1
                self._set(leader=self._address, epoch=epoch, role=LEADER)
                log.info("master %s leads (epoch %d)", self._address, epoch)
            return
        self._step_down(f"the leader key names {named!r}")
        self._watch_from = current.mod_revision + 1
        if named == me:  # under a lease of ours that lapsed here: end it now, campaign afresh
            self._set(role=STANDBY, leader="", epoch=0)
            with contextlib.suppress(Exception):
                await client.revoke_lease(current.lease)
            return
        self._set(role=STANDBY, leader=named, epoch=current.create_revision)

    async def _forged_key(self, client: aetcd.Client, current: Any) -> bool:
        """The leader key holds no master's claim: a leader deletes it (True: campaign again at once); a
        standby keeps the leader it knew and deletes the key once it outlived a lease TTL."""
        revision = current.mod_revision
        if self._forged[0] != revision:
            self._forged = (revision, time.monotonic())
            with self._lock:
                self.num_forged += 1
            log.warning(
                "master %s: the etcd key %s holds %r, which no master wrote (no valid claim): ignored",
                self._address,
                self.leader_key.decode(),
                current.value[:64],
            )
        self._watch_from = revision + 1
        leading = self.role == LEADER
        if not leading and time.monotonic() - self._forged[1] < self.lease_ttl_s:
            return False
        tx = client.transactions
        await client.transaction(
            compare=[tx.mod(self.leader_key) == revision], success=[tx.delete(self.leader_key)], failure=[]
        )
        return leading

    async def _wait_round(self, client: aetcd.Client) -> None:
        """A leader sleeps a keep-alive interval; a standby watches the leader key as long (wakes on a change)."""
        assert self._stop is not None
        interval_s = self.lease_ttl_s / 3
        if self._role == LEADER:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval_s)
            return
        watch = asyncio.ensure_future(
            client.watch_once(self.leader_key, timeout=interval_s, start_revision=self._watch_from)
        )
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait([watch, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            watch.cancel()
        if watch.done() and not watch.cancelled():
            exc = watch.exception()
            if exc is not None and not isinstance(exc, aetcd.exceptions.WatchTimeoutError):
                raise exc
