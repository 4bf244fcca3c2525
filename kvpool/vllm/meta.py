"""What the scheduler half tells the worker halves each step, and what they report back.

Both cross vLLM's process boundary (pickled) in the default multi-process engine: plain dataclasses of
ints, bytes and `kvpool.connector.plan.LoadPlan`s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.connector.plan import LoadPlan

try:  # the base classes vLLM's runner checks; plain objects when vLLM is absent (unit tests of the halves)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # pragma: no cover - kvpool.vllm is used only under vLLM
    KVConnectorMetadata = object  # type: ignore[misc,assignment]
    KVConnectorWorkerMetadata = object  # type: ignore[misc,assignment]


@dataclass(slots=True)
class LoadSpec:
    """Load pool blocks `[plan.pull_start, plan.pull_end)` of a request into vLLM blocks `block_ids`
    (one id per pool block, in order), then release the plan's read lease (the worker owns it from here).
    `sync`: inside this step, before the forward; else in the background, reporting the request in
    `finished_recving` when done."""

    request_id: str
    plan: LoadPlan
    block_ids: list[int]
    sync: bool = False


@dataclass(slots=True)
class SaveSpec:
    """Publish chain blocks `[start_block, start_block + len(block_ids))` of a request, read from vLLM
    blocks `block_ids` after this step's forward. `hashes` are the chain's hashes up to the last one saved
    (the parent of `start_block` included). `final`: the request finished; its blocks are freed only once
    the worker reports it in `finished_sending` (B16)."""

    request_id: str
    ns: bytes
    hashes: list[bytes]
    start_block: int
    block_ids: list[int]
    flush_epoch: int | None
    final: bool = False


@dataclass(slots=True)
class KVPoolMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One engine step's work for the workers. `step_tokens`: (new tokens, cached tokens) of each request
    scheduled in the step, for the online recompute model."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    step_tokens: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class PullSample:
    """One completed pull: `nbytes` in `seconds` over the link the plan predicted with."""

    nbytes: int
    seconds: float
    alpha_s: float
    beta_bytes_per_s: float
    request_id: str = ""


@dataclass(slots=True)
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Observations of one step on the workers: the forward's time, the pulls that completed, failed loads.

    `forward`: (new tokens, cached tokens, seconds) when the step computed exactly one request's tokens
    (a batch's time cannot be attributed); `pulls`: completed pull samples."""

    forward: tuple[int, int, float] | None = None
    pulls: list[PullSample] = field(default_factory=list)
    load_failures: dict[str, int] = field(default_factory=dict)
    """request id -> leading chain blocks intact after a load that failed part-way."""
    loads_done: dict[str, float] = field(default_factory=dict)
    """request id -> seconds its load took (pull and copy into vLLM's blocks), for every load that ended
    (intact, partial or failed): the scheduler ends its pull in the ledger then (B39)."""
    links: dict[str, tuple[float, float]] = field(default_factory=dict)
    """store data address -> (alpha_s, beta_bytes_per_s) the worker's transport measured."""

    def aggregate(self, other: KVPoolWorkerMetadata) -> KVPoolWorkerMetadata:
        """Tensor-parallel workers each report the same step: keep one forward time (the slowest), every pull."""
        forward = self.forward
        if other.forward is not None and (forward is None or other.forward[2] > forward[2]):
            forward = other.forward
        failures = dict(self.load_failures)
        for rid, n in other.load_failures.items():
            failures[rid] = min(n, failures.get(rid, n))
        links = {**self.links, **other.links}
        done = dict(self.loads_done)
        for rid, seconds in other.loads_done.items():  # a load ends when its slowest worker's part did
            done[rid] = max(seconds, done.get(rid, seconds))
        return KVPoolWorkerMetadata(
            forward=forward,
            pulls=self.pulls + other.pulls,
            load_failures=failures,
            loads_done=done,
            links=links,
        )
