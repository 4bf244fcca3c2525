"""Data-plane health of each store node, fed by the readers and writers that move its bytes.

A store can answer heartbeats (control plane) while its data plane fails: writes refused, transfers
erroring, bytes that fail their checksum. Members report such failures (`ReportDataPlaneFailure`; a
reader's checksum report, `ReportBadReplica`, counts too) and the master keeps one `DataPlaneHealth` per
store record (a new epoch starts healthy):

- `ok` → `suspect` on a failure; `suspect` → `failed` after `fail_after` failures of any kind within
  `window_ms`, failures closer than `coalesce_ms` counting once (one pull that read a corrupted document
  reports each bad block: that is one event, not a failing store). A checksum failure is one failure like the others: the bad replica itself is dropped at
  once (`ReportBadReplica`) and a read never returns bad bytes (readers verify), so one corrupted block
  (a RAM fault in one slot) costs that block, not every block of the store; a store that keeps returning
  bad bytes fails.
- (writes counted at commit, not a data-plane state: a store that left reserved slots unwritten at
  `fail_after` commits in a row is *gray*, `note_commit`: placed on only when the healthy stores have no
  room, for `backoff_ms` or until a commit finds all its slots written)
- (silence, not a data-plane state: a store with no heartbeat for `stale_after_ms` is not offered to
  readers either, `silent`, and is again from its next heartbeat)
- `failed`: no new blocks are placed on it and matches do not offer its replicas (a block whose only
  replicas are there ends the match: the rest is recomputed), for a back-off (`backoff_ms`, doubling on
  each failed probe or failure on trial, up to `max_backoff_ms`).
- After the back-off it is due a `probe` (still neither placed on nor offered): the master has the store
  copy one of its own committed blocks through its own data plane into a spare slot
  (`kvpool.master.dataplane_probe`: its UCX listener, memory and checksums, end to end). A failed probe
  fails it again (longer back-off); a passed one puts it on `trial`: placed on and offered again, so real
  transfers check it too. A failure reported during `trial_ms` fails it again (longer back-off); a clean
  `trial_ms` makes it `ok`.

Mutated only under the master's lock; time comes from the master's clock.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvpool.errors import InvalidArgument, NotFound
from kvpool.index.results import MatchResult
from kvpool.types import Location

if TYPE_CHECKING:
    from kvpool.master.core import Master
    from kvpool.master.nodes import NodeRecord
    from kvpool.master.settings import MasterSettings

log = logging.getLogger(__name__)

KINDS = ("write", "read", "checksum")
"""What failed: a write refused or lost, a read that erred in transit, bytes that failed their checksum."""
MAX_DETAIL_CHARS = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPlanePolicy:
    fail_after: int = 3
    window_ms: int = 10_000
    coalesce_ms: int = 1_000  # failures of one store closer than this are one event (one pull, one burst)
    backoff_ms: int = 5_000
    max_backoff_ms: int = 60_000
    trial_ms: int = 10_000

    @classmethod
    def from_settings(cls, s: MasterSettings) -> DataPlanePolicy:
        return cls(
            fail_after=s.dataplane_fail_after,
            window_ms=s.dataplane_window_ms,
            coalesce_ms=s.dataplane_coalesce_ms,
            backoff_ms=s.dataplane_backoff_ms,
            max_backoff_ms=s.dataplane_max_backoff_ms,
            trial_ms=s.dataplane_trial_ms,
        )


@dataclass(slots=True)
class DataPlaneHealth:
    """One store's data-plane state (see the module docstring)."""

    state: str = "ok"  # ok | suspect | failed | probe | trial
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=64))  # failure times (ms), bounded
    until_ms: int = 0  # failed: not used before this; trial: ok after this without a failure
    backoff_ms: int = 0  # the last back-off (0: none yet)
    num_failures: int = 0  # reported since the store registered (this epoch)
    num_probes: int = 0
    num_probes_failed: int = 0
    last_error: str = ""
    write_streak: int = 0  # commits in a row that left some of its reserved slots unwritten (`note_commit`)
    num_unwritten_slots: int = 0  # reserved for a writer, not written (or not committed) at commit
    gray_until_ms: int = 0  # writes keep failing: placed on only when the healthy stores have no room
    num_grayed: int = 0

    def record(self, kind: str, detail: str, now_ms: int, policy: DataPlanePolicy) -> bool:
        """One reported failure; True when it made the store `failed` (it was not already)."""
        self.refresh(now_ms, policy)
        self.num_failures += 1
        self.last_error = f"{kind}: {detail[:MAX_DETAIL_CHARS]}"
        if self.state in ("failed", "probe"):
            return False  # late reports of transfers begun before it failed: it is out already
        if self.state != "trial" and self.recent and now_ms - self.recent[-1] < policy.coalesce_ms:
            return False  # the same event: one pull that read several bad blocks, one burst of refusals
        self.recent.append(now_ms)
        while self.recent and self.recent[0] < now_ms - policy.window_ms:
            self.recent.popleft()
        if self.state == "trial" or len(self.recent) >= policy.fail_after:
            self._fail(now_ms, policy, again=self.state == "trial")
            return True
        self.state = "suspect"
        return False

    def _fail(self, now_ms: int, policy: DataPlanePolicy, *, again: bool) -> None:
        grown = self.backoff_ms * 2 if again else policy.backoff_ms
        self.backoff_ms = min(max(grown, policy.backoff_ms), policy.max_backoff_ms)
        self.state, self.until_ms = "failed", now_ms + self.backoff_ms
        self.recent.clear()

    def probe_done(self, ok: bool, detail: str, now_ms: int, policy: DataPlanePolicy) -> None:
        """The result of the probe of a store in `probe` state: passed → `trial`, failed → `failed` with a
        doubled back-off. A result for a store no longer in `probe` (it re-registered meanwhile) is dropped."""
        if self.state != "probe":
            return
        self.num_probes += 1
        if ok:
            self.state, self.until_ms = "trial", now_ms + policy.trial_ms
            return
        self.num_probes_failed += 1
        self.last_error = f"probe: {detail[:MAX_DETAIL_CHARS]}"
        self._fail(now_ms, policy, again=True)

    def refresh(self, now_ms: int, policy: DataPlanePolicy) -> str:
        """Advance by time: a back-off over → `probe`; a clean trial, or a suspect with no failure in the
        window → `ok`. Returns the state."""
        if self.state == "failed" and now_ms >= self.until_ms:
            self.state = "probe"
        elif self.state == "trial" and now_ms >= self.until_ms:
            self.state, self.backoff_ms = "ok", 0
        elif self.state == "suspect" and (not self.recent or self.recent[-1] < now_ms - policy.window_ms):
            self.state = "ok"
            self.recent.clear()
        return self.state

    def usable(self, now_ms: int, policy: DataPlanePolicy) -> bool:
        """Worth placing on and reading from now."""
        return self.refresh(now_ms, policy) not in ("failed", "probe")

    def record_commit(self, reserved: int, written: int, now_ms: int, policy: DataPlanePolicy) -> bool:
        """A commit found `written` of the `reserved` slots a reservation placed here written and committed;
        counted in failures, not seconds: `fail_after` commits in a row with an unwritten slot make it gray
        (True when this one did) for `backoff_ms`: no new reservation while a healthy store has room. A
        commit with every slot written ends the streak, so one transient error takes no store out."""
        if written >= reserved:
            self.write_streak, self.gray_until_ms = 0, 0
            return False
        self.num_unwritten_slots += reserved - written
        self.write_streak += 1
        if self.write_streak < policy.fail_after or self.gray_until_ms > now_ms:
            return False
        self.gray_until_ms = now_ms + policy.backoff_ms  # after it, one more failing commit: gray again
        self.num_grayed += 1
        return True


def note_commit(m: Master, reserved: dict[str, int], written: dict[str, int]) -> None:
    """Under the lock: one reservation's commit, per store it placed on (`reserved`: slots per node id;
    `written`: those written and committed). O(stores of the reservation)."""
    now_ms = m.clock.now_ms()
    for node_id, n in reserved.items():
        rec = m.st.nodes.get(node_id)
        if rec is None or not rec.is_store:
            continue
        if rec.dataplane.record_commit(n, written.get(node_id, 0), now_ms, m.dataplane_policy):
            log.warning(
                "store %s left reserved slots unwritten at %d commits in a row: no new reservations "
                "there while other stores have room, for %d ms",
                *(node_id, rec.dataplane.write_streak, m.dataplane_policy.backoff_ms),
            )


def report_failure(m: Master, node_id: str, epoch: int, kind: str, detail: str) -> None:
    """A member saw the data plane of store `node_id` fail (`epoch` 0: whichever process holds the id now;
    another epoch than the registered one: about an earlier process, ignored)."""
    if kind not in KINDS:
        raise InvalidArgument(f"kind must be one of {KINDS}, got {kind[:32]!r}")
    if not node_id:
        raise InvalidArgument("node_id must be non-empty")
    with m.lock:
        rec = m.st.nodes.get(node_id)
        if rec is None or not rec.is_store:
            raise NotFound(f"no store node {node_id[:64]!r}")
        if epoch and epoch != rec.epoch:
            return
        failed = rec.dataplane.record(kind, detail, m.clock.now_ms(), m.dataplane_policy)
        backoff_ms = rec.dataplane.backoff_ms
    if failed:
        log.warning(
            "store %s data plane failed (%s: %s): not placed on or read from for %d ms",
            *(node_id, kind, detail[:MAX_DETAIL_CHARS], backoff_ms),
        )


def usable(m: Master, rec: NodeRecord) -> bool:
    """Under the lock: `rec`'s data plane may take new blocks and serve reads now."""
    return rec.dataplane.usable(m.clock.now_ms(), m.dataplane_policy)


def silent(m: Master, rec: NodeRecord, now_ms: int) -> bool:
    """`rec` sent no heartbeat for over `stale_after_ms` (paused, cut off, or dying): readers are not sent
    to it (a pull from a paused store would stall until its timeout); its next heartbeat brings it back."""
    return now_ms - rec.last_seen_ms > m.settings.stale_after_ms


def offered(m: Master, res: MatchResult, nodes: list[NodeRecord]) -> MatchResult:
    """Under the lock: `res` without the replicas on stores whose data plane failed or that fell silent
    (`silent`; `nodes`: the records its replicas name: the cost is per node named, whatever the index's
    size); the match ends at the first block left without a replica (the rest is recomputed)."""
    now_ms = m.clock.now_ms()
    bad = {n.node_id for n in nodes if n.is_store and (silent(m, n, now_ms) or not usable(m, n))}
    if not bad:
        return res
    kept: list[tuple[Location, ...]] = []
    for locs in res.locations:
        keep = tuple(x for x in locs if x.node_id not in bad)
        if not keep:
            break
        kept.append(keep)
    names = list(dict.fromkeys(x.node_id for locs in kept for x in locs))
    at = {n: i for i, n in enumerate(names)}
    rec = np.zeros(
        len(kept),
        dtype=[
            ("rep_node", np.int32),
            ("rep_slot", np.int64),
            ("rep_gen", np.int64),
            ("rep_local", np.bool_),
        ],
    )
    for i, locs in enumerate(kept):
        rec[i] = (at[locs[0].node_id], locs[0].slot, locs[0].generation, locs[0].local)
    extra = {i: locs[1:] for i, locs in enumerate(kept) if len(locs) > 1}
    return MatchResult(len(kept), res.lease_id, res.lease_expiry_ms, node_ids=names, records=rec, extra=extra)
