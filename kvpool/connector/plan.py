"""What a load decided and what it did: the values passed between the decision half and the transfer half.

`KVConnector.plan_load` (match + decide) returns a `LoadPlan`; `KVConnector.pull` (the transfer half)
reads the plan's pool blocks. The kvpool runner calls both in one process; a vLLM engine calls the first
in its scheduler process and the second in its worker processes, so a plan is a plain picklable value.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from kvpool.cost import LinkLike
from kvpool.types import Location, Match

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
    """What one load did; units in names. `decision` is "none" | "local" | "pull" | "recompute" | "degraded"."""

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
    num_pulls_in_flight: int = 0
    queued_bytes: int = 0
    compute_wait_s: float = 0.0  # seconds of forwards queued ahead on the model at the decision
    shared_match: bool = False  # decided on another request's recent answer, no MatchPrefix sent

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def reset(self) -> None:
        """Back to a load that decided nothing yet (the prompt's size kept)."""
        fresh = LoadStats(num_prompt_tokens=self.num_prompt_tokens)
        for f in fields(self):
            setattr(self, f.name, getattr(fresh, f.name))


@dataclass(slots=True)
class LoadPlan:
    """The decision half's answer for one prompt (`KVConnector.plan_load`).

    - `hashes`: the prompt's reusable block hashes (at most `(num_tokens - 1) // block_size`: the last
      token is always computed).
    - `num_local_blocks`: leading blocks the caller already holds (node-local tier, or vLLM's own prefix
      cache); `num_pool_blocks`: leading blocks the pool matched; `num_load_blocks`: leading blocks the cost
      model chose to reuse (0: recompute everything). Blocks `[pull_start, pull_end)` come from the pool.
    - `replicas[i]`, `addresses` (store node id -> data address): where pool block i may be read, under
      the read lease `lease_id` (None: no lease is held; `KVConnector.release` drops it).
    - `pull_timeout_s`: past it a pull is abandoned and the rest recomputed; `link`: the calibrated link
      the prediction used (None when nothing is pulled), so an observed pull can correct the model.
    - `flush_epoch`: the master's flush epoch when the load began: KV computed from this load is published
      under it, so a namespace invalidated since refuses it.
    - `pull_ticket`: the id of this plan's pull in the connector's `PullLedger` (None: not pulling, or
      released); `KVConnector.release` ends it, once.
    """

    ns: bytes
    stats: LoadStats
    hashes: list[bytes] = field(default_factory=list)
    num_local_blocks: int = 0
    num_pool_blocks: int = 0
    num_load_blocks: int = 0
    replicas: list[tuple[Location, ...]] = field(default_factory=list)
    addresses: dict[str, str] = field(default_factory=dict)
    lease_id: int | None = None
    pull_timeout_s: float = 0.0
    link: LinkLike | None = None
    flush_epoch: int | None = None
    pull_ticket: str | None = None

    def take(self, match: Match | None, block_size: int) -> None:
        """Fill the pool's side (and the stats' matched counts) from a match answer, its lease included
        (None: nothing from the pool). `num_local_blocks` is set before."""
        self.lease_id, self.num_pool_blocks, self.replicas, self.addresses = None, 0, [], {}
        if match is not None:
            self.lease_id = match.lease_id
            self.num_pool_blocks = min(match.num_matched, len(self.hashes))
            self.replicas = list(match.replicas[: self.num_pool_blocks])
            self.addresses = {n: info.data_address for n, info in match.nodes.items() if info.data_address}
        self.stats.num_pool_blocks = self.num_pool_blocks
        self.stats.num_matched_tokens = max(self.num_pool_blocks, self.num_local_blocks) * block_size

    @property
    def pull_start(self) -> int:
        """First block read from the pool: the ones before it are the caller's own."""
        return min(self.num_load_blocks, self.num_local_blocks)

    @property
    def pull_end(self) -> int:
        """One past the last block read from the pool (== `pull_start` when nothing is pulled)."""
        return max(self.pull_start, min(self.num_load_blocks, self.num_pool_blocks))


@dataclass(slots=True)
class LoadedPrefix:
    """The reused blocks' bytes (uint8, `block_nbytes` each, in chain order) and the load's stats."""

    blocks: list[np.ndarray] = field(default_factory=list)
    stats: LoadStats = field(default_factory=LoadStats)
    pulled: list[tuple[bytes, np.ndarray]] = field(default_factory=list)
    """(block hash, bytes) of the pulled blocks, for `KVConnector.keep_pulled` off the TTFT path."""
    pulled_parent: bytes | None = None
    """The chain parent of the first pulled block (None: the namespace root)."""
    flush_epoch: int | None = None
    """The master's flush epoch as this node knew it when the load began: KV computed from this load is
    published under it (`KVConnector.publish`), so a namespace invalidated since refuses it."""
    forward_id: int | None = None
    """This request's forward in the connector's `ComputeQueue` (None: none registered): the caller's
    forward `start`s and `release`s it (`NodeRuntime.compute_prompt`)."""
