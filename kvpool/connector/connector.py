"""Load a prompt's cached prefix into the model and publish new full blocks (prefill and decode).

`load_prefix` (data flow steps 2-3 of DESIGN.md):
  1. The reusable span is at most `(len(tokens) - 1) // block_size` blocks: a fully cached prompt still
     computes its last token (field case B06); the partial tail is never reused.
  2. `MatchPrefix` (counting the hit or not, with a read lease) gives the pool's matched run; the
     node-local tier gives its own leading run.
  3. The cost model picks k leading blocks to reuse (local ones cost ~0; pool ones `α + bytes/β`).
  4. Local blocks are copied from the tier; pool blocks are pulled over the transport from a replica,
     checksum and generation verified. A failed block is retried once on another replica (or the same);
     if it fails again only the blocks before it are reused, the bad replica is reported to the master
     (so the next lookup does not offer it: B18), and the rest is recomputed.
  5. The lease is released in every case (B13).
`publish` (step 5): reserve → write → commit through the pool client, off the TTFT path.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvpool.client.types import PutResult
from kvpool.connector.breaker import PoolBreaker
from kvpool.connector.local_tier import LocalTier
from kvpool.connector.pull import pull_blocks
from kvpool.cost import LOCAL_LINK, LinkEstimate, RecomputeModel, decide_reuse, t_transfer_s
from kvpool.cost.online import OnlineCalibration
from kvpool.errors import DeadlineExceeded, TransferError, Unavailable

log = logging.getLogger(__name__)

MIN_PULL_DEADLINE_S = 0.25
"""Floor of a pull's deadline: below it, scheduling noise on a busy host would abandon healthy pulls."""

FORCE_DECISION_ENV = "KVPOOL_FORCE_DECISION"
"""Benchmarks only: `pull` (load every hit block) | `recompute` (load none) | `auto` (default, the cost
model). Forced loads still report the cost model's predictions: `predicted_pull_s` is then the predicted
load of every hit block, and `reason` says what `auto` would have done."""


def forced_decision() -> str:
    """The value of `KVPOOL_FORCE_DECISION` (read per load), "auto" when unset or unknown."""
    value = os.environ.get(FORCE_DECISION_ENV, "auto").strip().lower()
    return value if value in ("pull", "recompute") else "auto"


@dataclass(slots=True)
class LoadStats:
    """What one load did; units in names. `decision` is "none" | "local" | "pull" | "recompute"."""

    num_prompt_tokens: int = 0
    num_matched_tokens: int = 0
    num_reused_tokens: int = 0
    num_pulled_tokens: int = 0
    num_local_tokens: int = 0
    num_pool_blocks: int = 0
    pulled_bytes: int = 0
    num_failed_blocks: int = 0
    decision: str = "none"
    match_s: float = 0.0
    pull_s: float = 0.0
    predicted_pull_s: float = 0.0
    predicted_recompute_s: float = 0.0
    predicted_compute_s: float = 0.0
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class LoadedPrefix:
    """The reused blocks' bytes (uint8, `block_nbytes` each, in chain order) and the load's stats."""

    blocks: list[np.ndarray] = field(default_factory=list)
    stats: LoadStats = field(default_factory=LoadStats)
    pulled: list[tuple[bytes, np.ndarray]] = field(default_factory=list)
    """(block hash, bytes) of the pulled blocks, for `KVConnector.keep_pulled` off the TTFT path."""
    flush_epoch: int | None = None
    """The master's flush epoch as this node knew it when the load began: KV computed from this load is
    published under it (`KVConnector.publish`), so a namespace invalidated since refuses it."""


class KVConnector:
    """Pool + local tier access for one node. Thread-safe as far as its clients are.

    Args:
        master: a `kvpool.client.MasterClient`.
        pool: a `kvpool.client.PoolClient` (publishes: reserve, write, commit).
        transport: a `transfer.Transport` (pulls).
        block_size, block_nbytes: the KV layout's figures.
        recompute: the calibrated recompute model of this node's runner (corrected online by
            `calibration` from the forwards and pulls this node runs; see kvpool.cost.online).
        local_tier: the node-local tier (may have capacity 0).
        lease_ttl_ms: read lease for pulls; pull_timeout_s: deadline per pull batch.
    """

    def __init__(
        self,
        *,
        master: Any,
        pool: Any,
        transport: Any,
        node_id: str,
        block_size: int,
        block_nbytes: int,
        recompute: RecomputeModel,
        local_tier: LocalTier,
        num_replicas: int = 1,
        lease_ttl_ms: int = 10_000,
        pull_timeout_s: float = 10.0,
        margin: float = 0.1,
        breaker: PoolBreaker | None = None,
    ) -> None:
        self.master = master
        self.pool = pool
        self.transport = transport
        self.node_id = node_id
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.calibration = OnlineCalibration(recompute)
        self.local_tier = local_tier
        self.num_replicas = num_replicas
        self.lease_ttl_ms = lease_ttl_ms
        self.pull_timeout_s = pull_timeout_s
        self.margin = margin
        self.breaker = breaker or PoolBreaker()
        self.flush_epoch: int | None = None  # the master's, from the last heartbeat (None: not heard yet)

    @property
    def recompute(self) -> RecomputeModel:
        """The recompute model decisions use now (the calibrated one, corrected online)."""
        return self.calibration.recompute

    def pull_deadline_s(self, load_deadline_s: float) -> float:
        """How long a pull may run before it is abandoned and the rest recomputed: the cost model's
        deadline (past it every predicted saving is gone), doubled for timing noise, at least
        `MIN_PULL_DEADLINE_S` and at most the configured `pull_timeout_s`."""
        return min(self.pull_timeout_s, max(2.0 * load_deadline_s, MIN_PULL_DEADLINE_S))

    def max_reusable_blocks(self, num_tokens: int) -> int:
        """Blocks that may be reused for a prompt of `num_tokens`: the last token is always computed."""
        return max(0, (num_tokens - 1) // self.block_size)

    def link_to_pool(self, addresses: Sequence[str]) -> LinkEstimate | None:
        """The slowest calibrated link among the stores we would pull from (conservative)."""
        links = []
        for address in set(addresses):
            try:
                link = self.transport.link(address)
            except Exception as exc:  # noqa: BLE001 - an unreachable store: no link estimate
                log.debug("no link estimate for %s: %s", address, exc)
                continue
            if link.beta_bytes_per_s > 0:  # 0: the probe measured no bandwidth (e.g. probe_bytes=0)
                links.append(link)
        if not links:
            return None
        return min(links, key=lambda lk: lk.beta_bytes_per_s)

    def load_prefix(
        self,
        ns: bytes,
        tokens: Sequence[int],
        hashes: Sequence[bytes],
        *,
        count_hit: bool,
        request_id: str = "",
        use_cache: bool = True,
    ) -> LoadedPrefix:
        """Fetch the reusable leading blocks of a prompt (see the module docstring). Never raises for a
        pool failure: a failed load falls back to recompute of exactly the missing span."""
        stats = LoadStats(num_prompt_tokens=len(tokens))
        out = LoadedPrefix(stats=stats, flush_epoch=self.flush_epoch)
        max_blocks = min(self.max_reusable_blocks(len(tokens)), len(hashes))
        if not use_cache or max_blocks == 0:
            return out
        candidates = list(hashes[:max_blocks])
        t0 = time.perf_counter()
        match = None
        if self.breaker.allow():
            try:
                match = self.master.match(
                    ns, candidates, count_hit=count_hit, lease_ttl_ms=self.lease_ttl_ms,
                    num_prompt_tokens=len(tokens), request_id=request_id,
                )  # fmt: skip
                self.breaker.record(True)
            except Exception as exc:  # noqa: BLE001 - the master being down means recompute, not failure
                self.breaker.record(False)
                log.warning("[%s] match failed, recomputing: %s", request_id, exc)
        else:
            stats.decision = "degraded"
        stats.match_s = time.perf_counter() - t0
        num_pool = match.num_matched if match is not None else 0
        stats.num_pool_blocks = num_pool
        num_local = self.local_tier.leading_run(ns, candidates)
        stats.num_matched_tokens = max(num_pool, num_local) * self.block_size
        try:
            self._load(ns, candidates, match, num_pool, num_local, out, request_id)
        finally:
            if match is not None and match.lease_id:
                try:
                    self.master.release_lease(match.lease_id)
                except Exception as exc:  # noqa: BLE001 - the lease expires on its own
                    log.warning("[%s] release_lease failed: %s", request_id, exc)
        stats.num_reused_tokens = len(out.blocks) * self.block_size
        return out

    def _load(
        self,
        ns: bytes,
        candidates: list[bytes],
        match: Any,
        num_pool: int,
        num_local: int,
        out: LoadedPrefix,
        request_id: str,
    ) -> None:
        stats = out.stats
        num_hit = max(num_pool, num_local)
        if num_hit == 0:
            return
        addresses = [match.data_address(loc.node_id) for reps in match.replicas for loc in reps
                     if not loc.local and match.data_address(loc.node_id)] if match else []  # fmt: skip
        link = self.link_to_pool(addresses) if num_pool > num_local else None
        cal = self.calibration
        decision = decide_reuse(
            num_hit,
            self.block_size,
            stats.num_prompt_tokens,
            self.block_nbytes,
            cal.link(link) if link is not None else LOCAL_LINK,
            cal.recompute,
            num_local_blocks=num_local,
            margin=self.margin,
        )
        stats.predicted_pull_s = decision.predicted_load_s
        stats.predicted_recompute_s = decision.predicted_recompute_all_s
        n_rest = max(1, stats.num_prompt_tokens - num_hit * self.block_size)  # every hit block loaded
        stats.predicted_compute_s = cal.recompute.t_recompute_s(n_rest, stats.num_prompt_tokens - n_rest)
        stats.reason = decision.reason
        k = decision.num_load_blocks
        force = forced_decision()
        if force != "auto":
            k = num_hit if force == "pull" else 0
            n_local = min(k, num_local)
            stats.predicted_pull_s = t_transfer_s(
                (k - n_local) * self.block_nbytes, cal.link(link) if link is not None else LOCAL_LINK
            )
            stats.reason = f"forced_{force} (auto: {decision.reason})"
        if k == 0:
            stats.decision = "recompute"
            return
        num_from_local = min(k, num_local)
        for h in candidates[:num_from_local]:
            block = self.local_tier.get(ns, h)
            if block is None:  # evicted between the run check and now
                break
            out.blocks.append(block)
        stats.num_local_tokens = len(out.blocks) * self.block_size
        stats.decision = "local"
        if len(out.blocks) < k and match is not None:
            stats.decision = "pull"
            t0 = time.perf_counter()
            start = len(out.blocks)
            addrs = {node_id: info.data_address for node_id, info in match.nodes.items() if info.data_address}
            pulled, failed = pull_blocks(
                self.transport, self.master, ns, candidates, match.replicas, addrs,
                start=start, end=min(k, num_pool), block_nbytes=self.block_nbytes,
                timeout_s=self.pull_timeout_s if force == "pull" else self.pull_deadline_s(decision.load_deadline_s),
                request_id=request_id,
            )  # fmt: skip
            stats.pull_s = time.perf_counter() - t0
            stats.num_failed_blocks = failed
            self.breaker.record(bool(pulled) or failed == 0)
            out.blocks.extend(pulled)
            stats.num_pulled_tokens = len(pulled) * self.block_size
            stats.pulled_bytes = sum(b.nbytes for b in pulled)
            if link is not None and failed == 0 and pulled:
                cal.observe_pull(stats.pulled_bytes, stats.pull_s, link)
            out.pulled = list(zip(candidates[start:], pulled, strict=False))

    def keep_pulled(self, ns: bytes, loaded: LoadedPrefix) -> None:
        """Copy a load's pulled blocks into the node-local tier (called once the first token is out, so
        the copy stays off the TTFT path); clears `loaded.pulled`."""
        for h, block in loaded.pulled:
            self.local_tier.put(ns, h, block)
        loaded.pulled = []

    def publish(
        self,
        ns: bytes,
        hashes: Sequence[bytes],
        blocks: Sequence[np.ndarray],
        *,
        start_block: int,
        recompute_cost_s: Sequence[float] | None = None,
        request_id: str = "",
        flush_epoch: int | None = None,
    ) -> tuple[int, int]:
        """Publish blocks `start_block..` of a chain (`blocks[i]` is block `start_block + i`). `flush_epoch`:
        the `LoadedPrefix.flush_epoch` of the load the blocks were computed from (a namespace invalidated
        since refuses them; None: unchecked).

        Returns (num committed, num already present). Raises a `KVPoolError` on failure (the caller
        reports `publish_failed`); a partial failure aborts the reservation, so nothing half-visible.
        """
        mine = list(hashes[start_block : start_block + len(blocks)])
        for h, block in zip(mine, blocks, strict=True):
            self.local_tier.put(ns, h, block, report=False)  # reported once the master holds the block
        try:
            result = self._put(ns, hashes, start_block, mine, blocks, recompute_cost_s, flush_epoch)
        finally:
            self.local_tier.report_stored(ns, mine)
        if result is None:
            return 0, 0
        if result.num_failed:
            raise TransferError(f"{result.num_failed} of {len(blocks)} blocks could not be written")
        return result.num_committed, result.num_existing

    def _put(
        self,
        ns: bytes,
        hashes: Sequence[bytes],
        start_block: int,
        mine: list[bytes],
        blocks: Sequence[np.ndarray],
        recompute_cost_s: Sequence[float] | None,
        flush_epoch: int | None,
    ) -> PutResult | None:
        """`publish`'s pool write (None: nothing to write); records the outcome in the breaker."""
        if not blocks:
            return None
        if not self.breaker.allow():
            raise Unavailable("pool unreachable (degraded mode): not publishing")
        parent = hashes[start_block - 1] if start_block > 0 else None
        try:
            result = self.pool.put_blocks(
                ns, parent, mine, list(blocks), num_replicas=self.num_replicas,
                recompute_cost_s=list(recompute_cost_s or ()), writer_node_id=self.node_id,
                flush_epoch=flush_epoch,
            )  # fmt: skip
        except (Unavailable, DeadlineExceeded):
            self.breaker.record(False)
            raise
        self.breaker.record(True)
        return result

    def note_flush_epoch(self, flush_epoch: int) -> None:
        """A heartbeat answer's flush epoch: when it moved (a namespace was invalidated, or the master
        restarted), the local tier is dropped first, then the new epoch is what later loads publish under."""
        if self.flush_epoch is not None and flush_epoch != self.flush_epoch:
            log.info("a namespace was invalidated (flush epoch %d): dropping the local tier", flush_epoch)
            self.local_tier.clear()
        self.flush_epoch = flush_epoch

    def report_local_events(self, epoch: int) -> None:
        """Send queued local-tier stored/removed events to the master (best effort)."""
        for ns, stored, removed in self.local_tier.drain_events():
            try:
                self.master.report_local(self.node_id, epoch, ns, stored=stored, removed=removed)
            except Exception as exc:  # noqa: BLE001 - the master learns again on the next event
                log.debug("report_local failed: %s", exc)
