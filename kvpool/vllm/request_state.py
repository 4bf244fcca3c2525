"""The scheduler half's state of one request, the links the workers measured, and a request's report.

Plain values and a small thread-safe map: no vllm import (`kvpool.vllm.scheduler` uses them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvpool.connector.plan import LoadPlan
from kvpool.cost import LinkEstimate
from kvpool.errors import TransferError
from kvpool.hashing import Namespace, hash_blocks
from transfer import BlockRead, BlockResult


@dataclass(slots=True)
class RequestState:
    """The scheduler half's view of one request. `phase`: matching | decided | loading | done."""

    request: Any
    ns: Namespace | None = None
    digest: bytes = b""
    hashes: list[bytes] = field(default_factory=list)
    future: Future[LoadPlan] | None = None
    asked_s: float = 0.0
    plan: LoadPlan | None = None
    phase: str = "done"
    num_local_tokens: int = 0
    num_external_tokens: int = 0
    num_saved_blocks: int = 0
    num_matches: int = 0
    num_preemptions: int = 0
    load_failed: bool = False
    num_intact_blocks: int = 0
    wait_blocks: int = 0  # P/D decode: blocks its prefill engine published (waited for before matching)

    def lease_gone(self, num_computed_tokens: int, block_size: int) -> bool:
        """Would the decided plan now load blocks (vLLM's local hit shrank) although its lease was released
        (the earlier answer loaded nothing)? Loading them unleased could read freed slots (B13)."""
        plan = self.plan
        if plan is None or plan.lease_id or self.num_local_tokens == num_computed_tokens:
            return False
        return min(plan.num_load_blocks, plan.num_pool_blocks) * block_size > num_computed_tokens

    def may_ask_again(self, request: Any) -> bool:
        """A request asks the pool again only when it was preempted since (its blocks were freed), and
        never after a load of it failed (vLLM recomputes from the failure; asking again could loop)."""
        return not self.load_failed and int(getattr(request, "num_preemptions", 0)) > self.num_preemptions

    def extend_hashes(self, tokens: Sequence[int], n_blocks: int, block_size: int) -> None:
        """Hash blocks up to `n_blocks` incrementally: block i's parent is block i-1's hash (the namespace
        for block 0), the same tagged field either way (`kvpool.hashing`)."""
        have = len(self.hashes)
        if n_blocks <= have:
            return
        parent = self.hashes[-1] if self.hashes else self.digest
        self.hashes.extend(
            hash_blocks(parent, list(tokens[have * block_size : n_blocks * block_size]), block_size)
        )


class ReportedLinks:
    """The links the workers measured (their transport's connect probe, updated by every real transfer),
    as the decision connector's `transport.link`. Thread-safe. A store no worker has measured yet has no
    estimate: the decision then treats the pull as free and the pull deadline bounds the loss."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._links: dict[str, LinkEstimate] = {}

    def update(self, peer: str, link: LinkEstimate) -> None:
        with self._lock:
            self._links[peer] = link

    def link(self, peer: str) -> LinkEstimate:
        with self._lock:
            link = self._links.get(peer)
        if link is None:
            raise TransferError(f"no worker has measured the link to {peer} yet")
        return link

    def read_blocks(
        self, peer: str, reads: Sequence[BlockRead], out: Sequence[memoryview], *, timeout_s: float
    ) -> list[BlockResult]:
        """The scheduler half reads no blocks (its workers do): every read fails."""
        return [BlockResult(False, error="the vLLM scheduler half reads no blocks")] * len(reads)

    def close(self) -> None:
        return


def request_report(st: RequestState, block_size: int, block_nbytes: int) -> dict[str, Any]:
    """What the pool did for a request: the decision and its predictions, the tokens loaded (planned,
    and what arrived), and `num_saved_blocks`: the request's chain blocks queued for publishing (a
    publish that fails later shows in the log and the publisher's counters, not here)."""
    out: dict[str, Any] = {
        "num_saved_blocks": st.num_saved_blocks,
        "load_failed": st.load_failed,
        # a failed load: the leading blocks that arrived intact (vLLM recomputed from there; its
        # num_cached_tokens still counts the whole planned load)
        "num_intact_tokens": st.num_intact_blocks * block_size if st.load_failed else None,
        "num_preemptions": int(getattr(st.request, "num_preemptions", 0)),
    }
    plan = st.plan
    if plan is None:
        return out | {"decision": "none" if st.future is None else "no_answer"}
    s = plan.stats
    loaded = st.num_external_tokens // block_size  # a failed load: only its intact leading run
    if st.load_failed:
        loaded = max(0, st.num_intact_blocks - st.num_local_tokens // block_size)
    return out | {
        "decision": s.decision,
        "reason": s.reason,
        "num_pool_blocks": plan.num_pool_blocks,
        "num_loaded_tokens": loaded * block_size,
        "num_planned_load_tokens": st.num_external_tokens,
        "loaded_bytes": loaded * block_nbytes,
        "predicted_pull_s": s.predicted_pull_s,
        "predicted_recompute_s": s.predicted_recompute_s,
        "match_s": s.match_s,
    }
