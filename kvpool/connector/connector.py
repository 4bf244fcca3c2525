"""Load a prompt's cached prefix into the model and publish new full blocks (prefill, decode, vLLM).

A load has two halves: `plan_load` decides (steps 1-3 below: match and the cost model) and `pull`
transfers (step 4's pool part). `load_prefix` runs both for kvpool's own runner; the vLLM connector runs
the first in vLLM's scheduler and the second in its workers, with the same code.

`load_prefix` (docs/design.md "How a request flows", step 1):
  1. The reusable span is at most `(len(tokens) - 1) // block_size` blocks: a fully cached prompt still
     computes its last token (field case B06); the partial tail is never reused.
  2. The node-local tier gives its own leading run (all of it: no call); `MatchPrefix` (counting the
     hit or not, with a read lease) gives the pool's matched run. Requests on one prefix share one call
     in flight, and a recent answer on which the decision is not to pull decides without a call
     (`kvpool.connector.recent`).
  3. The cost model picks k leading blocks to reuse (local ones cost ~0; pool ones `α + bytes/β`).
  4. Local blocks are copied from the tier; pool blocks are pulled over the transport from a replica,
     checksum and generation verified. A failed block is retried once on another replica (or the same);
     if it fails again only the blocks before it are reused, the bad replica is reported to the master
     (so the next lookup does not offer it: B18), and the rest is recomputed.
  5. The lease is released in every case (B13), off the request path: queued to the connector's
     `LeaseReleaser`, which sends many ids per `ReleaseLeases` call from its own thread.
`publish` (step 5): reserve → write → commit through the pool client, off the TTFT path
(`kvpool.connector.publish`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from kvpool.client.faults import is_slow_transfer
from kvpool.connector.breaker import PoolBreaker
from kvpool.connector.convoy import TTL_FACTOR, peer_bytes, pool_addresses, slowest_link
from kvpool.connector.decide import decide_plan, forward_s
from kvpool.connector.local_tier import LocalTier
from kvpool.connector.plan import FORCE_DECISION_ENV, LoadedPrefix, LoadPlan, LoadStats, forced_decision
from kvpool.connector.ports import MasterPort, PoolPort, TransportPort
from kvpool.connector.publish import publish_chain
from kvpool.connector.pull import pull_blocks
from kvpool.connector.recent import RecentMatches, prefix_key
from kvpool.connector.releaser import LeaseReleaser
from kvpool.cost import LinkLike, PullLedger, RecomputeModel
from kvpool.cost.compute_queue import ComputeQueue
from kvpool.cost.online import OnlineCalibration
from kvpool.prompt import max_reusable_blocks
from kvpool.types import Match

__all__ = ["FORCE_DECISION_ENV", "KVConnector", "forced_decision"]

log = logging.getLogger(__name__)

MIN_PULL_DEADLINE_S = 0.25
"""Floor of a pull's deadline: below it, scheduling noise on a busy host would abandon healthy pulls."""


class KVConnector:
    """Pool + local tier access for one node. Thread-safe as far as its clients are.

    Args:
        master: the master link (`kvpool.connector.ports.MasterPort`, e.g. a `kvpool.client.MasterClient`).
        pool: the pool client that publishes (reserve, write, commit); None: this connector only loads.
        transport: link estimates and block reads (a `transfer.Transport`).
        block_size, block_nbytes: the KV layout's figures.
        recompute: the calibrated recompute model of this node's runner (corrected online by
            `calibration` from the forwards and pulls this node runs; see kvpool.cost.online).
        local_tier: the node-local tier (may have capacity 0).
        lease_ttl_ms: read lease for pulls; pull_timeout_s: deadline per pull batch.
        forwards: the forwards queued on this node's model (`kvpool.cost.compute_queue`), for a runner
            whose loads overlap other requests' forwards: decisions count the wait, `load_prefix`
            registers each request's forward. None: decisions see no compute queue.
    """

    def __init__(
        self,
        *,
        master: MasterPort,
        pool: PoolPort | None,
        transport: TransportPort,
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
        forwards: ComputeQueue | None = None,
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
        self.pulls = PullLedger()  # pulls decided and not yet ended, per store: their queue (B39)
        self.forwards = forwards  # forwards decided and not yet run on the model: the wait a load overlaps
        self.flush_epoch: int | None = None  # the master's, from the last heartbeat (None: not heard yet)
        self.releaser = LeaseReleaser(lambda ids: self.master.release_leases(ids))  # read leases, batched
        self.recent = RecentMatches()  # one match in flight per prefix; a fresh answer may decide alone

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
        return max_reusable_blocks(num_tokens, self.block_size)

    def link_to_pool(self, addresses: Sequence[str]) -> LinkLike | None:
        """The slowest calibrated link among the stores we would pull from (conservative); None: none."""
        return slowest_link(self.transport, addresses)

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
        """Fetch the reusable leading blocks of a prompt (see the module docstring): `plan_load`, the
        node-local tier's blocks, `pull`, `release`. Never raises for a pool failure: a failed load falls
        back to recompute of exactly the missing span. With `forwards`, the request's forward is queued
        (`LoadedPrefix.forward_id`): the caller runs it (`NodeRuntime.compute_prompt`) or releases it."""
        plan = self.plan_load(
            ns, tokens, hashes, count_hit=count_hit, request_id=request_id, use_cache=use_cache
        )
        forward_id = self._queue_forward(plan)
        out = LoadedPrefix(stats=plan.stats, flush_epoch=plan.flush_epoch, forward_id=forward_id)
        try:
            for h in plan.hashes[: plan.pull_start]:
                block = self.local_tier.get(ns, h)
                if block is None:  # evicted between the run check and now
                    break
                out.blocks.append(block)
            plan.stats.num_local_tokens = len(out.blocks) * self.block_size
            if plan.num_load_blocks > 0:
                plan.stats.decision = "local"
            if len(out.blocks) < plan.num_load_blocks and plan.pull_end > len(out.blocks):
                start = len(out.blocks)
                pulled = self.pull(plan, start=start, request_id=request_id)
                out.blocks.extend(pulled)
                out.pulled = list(zip(plan.hashes[start:], pulled, strict=False))
                out.pulled_parent = plan.hashes[start - 1] if start > 0 else None
        except BaseException:
            if self.forwards is not None:  # no caller will run this forward
                self.forwards.release(forward_id)
            raise
        finally:
            self.release(plan, request_id=request_id)
        plan.stats.num_reused_tokens = len(out.blocks) * self.block_size
        return out

    def plan_load(
        self,
        ns: bytes,
        tokens: Sequence[int],
        hashes: Sequence[bytes],
        *,
        count_hit: bool,
        request_id: str = "",
        use_cache: bool = True,
        num_local_blocks: int | None = None,
    ) -> LoadPlan:
        """The decision half of a load: `MatchPrefix` (counting the hit or not, with a read lease) and the
        cost model's choice of how many leading blocks to reuse.

        Args:
            ns, tokens, hashes: the namespace digest, the prompt's token ids and its full blocks' hashes.
            count_hit: count the hit (prefill) or not (decode: the request was counted at prefill).
            num_local_blocks: leading blocks the caller already holds (vLLM's own prefix cache); None:
                this connector's node-local tier's leading run.
        Returns:
            A `LoadPlan`. When it pulls (`pull_end > pull_start`) it holds the match's read lease: the
            caller runs `pull` and then `release` (also on failure). Otherwise no lease is held.
        Never raises for a pool failure: a failed match is a plan that recomputes (breaker: B19).
        """
        stats = LoadStats(num_prompt_tokens=len(tokens))
        plan = LoadPlan(ns=ns, stats=stats, flush_epoch=self.flush_epoch)
        max_blocks = min(self.max_reusable_blocks(len(tokens)), len(hashes))
        if not use_cache or max_blocks == 0:
            return plan
        plan.hashes = list(hashes[:max_blocks])
        if num_local_blocks is None:
            plan.num_local_blocks = self.local_tier.leading_run(ns, plan.hashes)
        else:
            plan.num_local_blocks = max(0, min(num_local_blocks, max_blocks))
        t0 = time.perf_counter()
        match = None
        if plan.num_local_blocks >= max_blocks:
            pass  # every reusable block is at hand: the pool has nothing to add, no call
        elif not self.breaker.allow():
            stats.decision = "degraded"
        else:
            shared, claim = self.recent.claim(prefix_key(ns, plan.hashes))
            if shared is not None and self._no_pull_on(plan, shared):
                stats.match_s = time.perf_counter() - t0
                return plan  # decided on another request's answer: no call, no lease
            held, plan.pull_ticket = plan.pull_ticket, None  # that answer's pull: seen by others meanwhile
            try:
                match = self.master.match(
                    ns,
                    plan.hashes,
                    count_hit=count_hit,
                    lease_ttl_ms=self.lease_ttl_ms,
                    num_prompt_tokens=len(tokens),
                    request_id=request_id,
                )
                self.breaker.record(True)
            except Exception as exc:  # noqa: BLE001 - the master being down means recompute, not failure
                self.breaker.record(False)
                log.warning("[%s] match failed, recomputing: %s", request_id, exc)
            finally:
                if claim is not None:
                    self.recent.publish(claim, match)
                self.pulls.withdraw(held)  # the decision below registers the pull it makes
        stats.match_s = time.perf_counter() - t0
        plan.take(match, self.block_size)
        try:
            self._decide(plan)
        finally:
            if plan.pull_end <= plan.pull_start:
                self.release(plan, request_id=request_id)
        return plan

    def _no_pull_on(self, plan: LoadPlan, shared: Match) -> bool:
        """Decide on a shared recent answer (`RecentMatches`): True when the plan pulls nothing (final, no
        lease); False when it would pull: the plan's pool side is cleared (the caller asks the master) and
        its pull stays registered meanwhile, so that the requests deciding next see it coming."""
        plan.take(shared, self.block_size)
        plan.lease_id = None  # the leader's, released by the leader
        self._decide(plan)
        if plan.pull_end > plan.pull_start:
            plan.take(None, self.block_size)
            plan.num_load_blocks = 0
            plan.stats.reset()
            return False
        plan.stats.shared_match = True
        return True

    def _decide(self, plan: LoadPlan) -> None:
        """Fill `plan.num_load_blocks`, its deadline and its predictions (`kvpool.connector.decide`), and
        enter a pull in the ledger."""
        num_pool, num_local = plan.num_pool_blocks, plan.num_local_blocks
        num_hit = max(num_pool, num_local)
        if num_hit == 0:
            return
        link = self.link_to_pool(pool_addresses(plan)) if num_pool > num_local else None
        decision, force = decide_plan(
            plan,
            link,
            pulls=self.pulls,
            forwards=self.forwards,
            calibration=self.calibration,
            block_size=self.block_size,
            block_nbytes=self.block_nbytes,
            margin=self.margin,
        )
        plan.pull_timeout_s = (
            self.pull_timeout_s if force == "pull" else self.pull_deadline_s(decision.load_deadline_s)
        )
        if plan.pull_end > plan.pull_start:  # last: released by `release`, which every caller runs
            plan.pull_ticket = self.pulls.register(
                peer_bytes(plan, self.block_nbytes, plan.pull_start, plan.pull_end),
                ttl_s=TTL_FACTOR * plan.pull_timeout_s,
            ).id

    def _queue_forward(self, plan: LoadPlan) -> int | None:
        """Register the plan's forward (the tokens it will not reuse) in `forwards`; None without one."""
        if self.forwards is None:
            return None
        n_prompt = plan.stats.num_prompt_tokens
        return self.forwards.register(
            forward_s(plan.num_load_blocks, n_prompt, self.block_size, self.recompute)
        )

    def pull(self, plan: LoadPlan, *, start: int | None = None, request_id: str = "") -> list[np.ndarray]:
        """The transfer half of a load: read blocks `[start, plan.pull_end)` from the pool (default start:
        `plan.pull_start`), checksums and generations verified, one retry on another replica (B18).

        Returns the leading run of intact blocks (uint8 arrays of `block_nbytes`, back to back in one
        buffer); fewer than asked when a block failed: the caller recomputes from there. Fills the plan's
        stats (`pull_s`, `num_failed_blocks`, `num_pulled_tokens`, `pulled_bytes`) and the breaker; an
        intact pull that ran alone corrects the online link overhead. Never raises for a pool failure.
        """
        stats = plan.stats
        start = plan.pull_start if start is None else start
        if start >= plan.pull_end:
            return []
        stats.decision = "pull"
        t0 = time.perf_counter()
        errors: list[str] = []
        pulled, failed = pull_blocks(
            self.transport,
            self.master,
            plan.ns,
            plan.hashes,
            plan.replicas,
            plan.addresses,
            start=start,
            end=plan.pull_end,
            block_nbytes=self.block_nbytes,
            timeout_s=plan.pull_timeout_s,
            request_id=request_id,
            errors=errors,
        )
        stats.pull_s = time.perf_counter() - t0
        stats.num_failed_blocks = failed
        # a pull that only ran past its deadline while the store answered (B39) is no pool failure
        self.breaker.record(bool(pulled) or failed == 0 or all(map(is_slow_transfer, errors)))
        stats.num_pulled_tokens = len(pulled) * self.block_size
        stats.pulled_bytes = sum(b.nbytes for b in pulled)
        solo = not self.pulls.overlapped(plan.pull_ticket)  # a convoy's time is the ledger's to learn
        if plan.link is not None and failed == 0 and pulled and solo:
            self.calibration.observe_pull(stats.pulled_bytes, stats.pull_s, plan.link)
        return pulled

    def release(self, plan: LoadPlan, *, request_id: str = "") -> None:
        """Drop the plan's read lease, if it holds one (idempotent; B13), and end its pull in the ledger
        (once: B39). Never blocks on the master: the lease id is queued to `releaser`, which sends it in a
        batch (a failed batch is logged and its leases expire on their own). Never raises."""
        ticket, plan.pull_ticket = plan.pull_ticket, None
        self.pulls.release(ticket, elapsed_s=plan.stats.pull_s or None)
        lease_id, plan.lease_id = plan.lease_id, None
        if lease_id:
            self.releaser.release(lease_id)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send the read leases still queued (bounded by `timeout_s`); call before closing the master link."""
        self.releaser.close(timeout_s)

    def keep_pulled(self, ns: bytes, loaded: LoadedPrefix) -> None:
        """Copy a load's pulled blocks into the node-local tier (called once the first token is out, so
        the copy stays off the TTFT path); clears `loaded.pulled`. A chain whose parent left the tier
        meanwhile is not kept (the tier holds whole chains only)."""
        hashes, blocks = [h for h, _ in loaded.pulled], [b for _, b in loaded.pulled]
        self.local_tier.put_chain(ns, loaded.pulled_parent, hashes, blocks)
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
        """Publish blocks `start_block..` of a chain (`blocks[i]` is block `start_block + i`) under the
        `flush_epoch` of the load they were computed from (None: unchecked); see
        `kvpool.connector.publish.publish_chain`. Returns (num committed, num already present); raises a
        `KVPoolError` on failure (the caller reports `publish_failed`)."""
        try:
            return publish_chain(
                self.pool,
                self.local_tier,
                self.breaker,
                ns,
                hashes,
                blocks,
                start_block=start_block,
                num_replicas=self.num_replicas,
                writer_node_id=self.node_id,
                recompute_cost_s=recompute_cost_s,
                flush_epoch=flush_epoch,
            )
        finally:  # the pool's answer for these prefixes changed: the next request asks again
            self.recent.forget(ns, hashes[: start_block + len(blocks)])

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
