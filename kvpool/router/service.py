"""The router's request path (replaces the demo's in-process orchestrator), transport-agnostic.

Per request (DESIGN.md data flow, steps 1, 6 and 7): admit (at most `max_inflight` at once: else
`ResourceExhausted`, answered 429) → hash the prompt's full blocks in the tenant's namespace → peek at
the global index (`count_hit=False, lease_ttl_ms=0`: no counters, no recency, no lease) → place it on a
prefill node by the policy → Prefill stream: the first token is TTFT → wait for `committed` (or
`publish_failed`) → hand off to the least-loaded decode node → stream its tokens. The nodes are called
through `kvpool.client.node_client.NodeClient` (typed events; a failed call is its `KVPoolError`).

A failed control plane costs hit rate, never requests: while the master is unreachable there is no peek
(the prompt is placed on the router's own record of where recent prefixes went, `AffinityRecord`, and
counted in `kvpool_router_unpeeked_requests_total`), the nodes serve from their node-local tiers and
recompute, and a hand-off whose publish could not commit (`publish_failed`) tells decode to recompute
the prompt (`prompt_committed=false`). The node list, the master's state, `/health` and failover to
another node are `kvpool.router.nodes`.

`generate` is a synchronous generator of `Event`s (the HTTP layer runs it in a worker thread). A
prefill failure is always before the client got anything; a decode stream is retried only while it has
sent no token (the first token, from prefill, is the same for any decode node). Metrics count requests,
not attempts (`kvpool.router.metrics`, field case B40).
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Collection, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.client.node_client import NodeClient
from kvpool.client.node_types import (
    DecodeRequest,
    DecodeTokens,
    Finished,
    FirstToken,
    PrefillRequest,
    Published,
)
from kvpool.client.types import Match, NodeStatus
from kvpool.errors import DeadlineExceeded, KVPoolError, ResourceExhausted, Unavailable
from kvpool.hashing import hash_blocks
from kvpool.prompt import max_reusable_blocks
from kvpool.router.affinity import AffinityRecord
from kvpool.router.metrics import RouterMetrics
from kvpool.router.model_info import ModelInfo
from kvpool.router.namespaces import NamespaceCache
from kvpool.router.nodes import NodeView
from kvpool.router.policy import Choice, RouteRequest, RoutingPolicy
from kvpool.router.settings import RouterSettings
from kvpool.router.state import Inflight, node_states
from kvpool.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Peeked:
    """Placement's picture of one prompt: the request, the match (a peek at the master's index, or the
    router's affinity record while the master is unreachable; None: no hits), the most blocks that can be
    reused, and the prompt's full-block hashes (recorded under the node that serves it)."""

    req: RouteRequest
    match: Match | None
    max_blocks: int
    hashes: Sequence[bytes]


@dataclass(slots=True)
class Event:
    """One step of a request. `kind`: "first" (first token, prefill stats), "tokens", "done"."""

    kind: str
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    prefill_node: str = ""
    decode_node: str = ""
    ttft_s: float = 0.0


class RouterService(NodeView):
    """The request path; `start` it (node list refresh) and `close` it."""

    def __init__(
        self,
        settings: RouterSettings,
        master: Any,
        model: ModelInfo,
        *,
        metrics: RouterMetrics | None = None,
    ) -> None:
        super().__init__(settings, master, metrics or RouterMetrics())
        self.model = model
        self.policy = RoutingPolicy(settings.policy, seed=settings.seed)
        self._policy_lock = threading.Lock()
        self._decode_rng = random.Random(settings.seed + 1)
        self.inflight = Inflight()  # prefill: until the first token
        self.decode_inflight = Inflight()  # decode: until the last token
        self._admitted = 0
        self._admit_lock = threading.Lock()
        self.namespaces = NamespaceCache(
            model, master, settings.namespace_cache_size, on_evict=self.metrics.namespace_evictions.inc
        )
        self.metrics.namespace_entries.set_function(lambda: len(self.namespaces))
        self.affinity = AffinityRecord(settings.affinity_blocks)
        self.node_client = NodeClient(timeout_s=settings.request_timeout_s)

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> RouterService:
        """First node list (a master that does not answer yet is no error: requests are answered 503,
        saying why, until it does) and the background refresh."""
        self.probe_master()
        self.start_refresh()
        return self

    def close(self) -> None:
        self.stop_refresh()
        self.node_client.close()

    def health(self) -> dict[str, Any]:
        """`/health`'s body (`NodeView.health_report`): the master is asked now (`check_master`: a failed
        answer marks it unreachable at once), the live nodes counted from its list or, while it is
        unreachable, from the last known ones."""
        self.check_master()
        return self.health_report(
            len(self.serving("prefill")), len(self.serving("decode")), inflight=self._admitted
        )

    # ---- placement --------------------------------------------------------------------------------
    def namespace(self, cache_salt: str) -> bytes:
        """The namespace digest of `cache_salt` (bounded LRU, registered with the master on first use;
        computed here, not registered, while the master is unreachable)."""
        if self.master_state.down:
            return bytes(self.model.namespace(cache_salt).digest())
        return self.namespaces.get(cache_salt)

    def place(self, tokens: Sequence[int], cache_salt: str) -> tuple[Choice, NodeStatus]:
        """Choose the prefill node (peek + policy); `Unavailable` when no prefill node is alive."""
        return self.choose_prefill(self.peek(tokens, cache_salt))

    def peek(self, tokens: Sequence[int], cache_salt: str) -> Peeked:
        """What placement needs of the pool for this prompt (one peek, reused by retries). The master
        unreachable (or failing now): no hits from the pool, the router's affinity record instead.
        `Unavailable` only when no prefill node is known."""
        if not self.serving("prefill"):
            raise self.no_node("prefill")
        layout = self.model.layout
        max_blocks = max_reusable_blocks(len(tokens), layout.block_size)
        match: Match | None = None
        hashes: Sequence[bytes] = ()
        if len(tokens) >= layout.block_size:
            hashes = hash_blocks(self.namespace(cache_salt), tokens, layout.block_size)
        if max_blocks > 0:
            if not self.master_state.down:
                match = self._peek_master(hashes[:max_blocks], cache_salt)
            if match is None:
                self.metrics.unpeeked.inc()
                match = self.affinity.match(hashes[:max_blocks])
        req = RouteRequest(
            prompt_len=len(tokens),
            block_size=layout.block_size,
            block_nbytes=layout.block_nbytes,
            pool_blocks=match.num_matched if match is not None else 0,
        )
        return Peeked(req, match, max_blocks, hashes)

    def _peek_master(self, hashes: Sequence[bytes], cache_salt: str) -> Match | None:
        """The master's match of `hashes` (no counters, no recency, no lease); None when it failed."""
        ns = self.namespace(cache_salt)
        try:
            return self.master.match(ns, hashes, count_hit=False, lease_ttl_ms=0)  # type: ignore[no-any-return]
        except (Unavailable, DeadlineExceeded) as exc:  # the master is down: no hits, no more peeks
            self.master_failed(exc)
        except KVPoolError as exc:
            log.warning("peek failed (%s); routing without pool hits", exc)
        return None

    def choose_prefill(self, peeked: Peeked, exclude: Collection[str] = ()) -> tuple[Choice, NodeStatus]:
        """The prefill node the policy chooses among `candidates` (counted in flight until its first token).
        One call per attempt: metrics are recorded per request by `generate`, not here."""
        req, match, max_blocks = peeked.req, peeked.match, peeked.max_blocks
        prefill = self.candidates("prefill", exclude)
        if not prefill:
            raise self.no_node("prefill")
        with self._policy_lock:
            states = node_states(prefill, match, self.inflight, max_blocks)
            choice = self.policy.choose(req, states)
            node = next(n for n in prefill if n.node.node_id == choice.node_id)
            self.inflight.begin(node.node.node_id, node.node.epoch, choice.prediction.service_s)
        return choice, node

    def pick_decode(self, exclude: Collection[str] = ()) -> NodeStatus:
        """The least-loaded decode node of `candidates` (own in-flight or reported queue); ties seeded."""
        decode = self.candidates("decode", exclude)
        if not decode:
            raise self.no_node("decode")

        def load(n: NodeStatus) -> int:
            return max(self.decode_inflight.get(n.node.node_id, n.node.epoch)[0], n.load.queue_len)

        best = min(load(n) for n in decode)
        with self._policy_lock:
            return self._decode_rng.choice([n for n in decode if load(n) == best])

    # ---- one request ------------------------------------------------------------------------------
    def admit(self) -> None:
        """Count one request in; `ResourceExhausted` when `max_inflight` are being served. Pair with `release`."""
        with self._admit_lock:
            if self._admitted >= self.settings.max_inflight:
                self.metrics.rejected.labels("overloaded").inc()
                raise ResourceExhausted(
                    f"the router is serving {self._admitted} requests (limit {self.settings.max_inflight}); "
                    "retry later"
                )
            self._admitted += 1
        self.metrics.inflight.inc()

    def release(self) -> None:
        with self._admit_lock:
            self._admitted -= 1
        self.metrics.inflight.dec()

    def _prefill(
        self, pnode: NodeStatus, service_s: float, req: PrefillRequest, t0: float
    ) -> tuple[FirstToken | None, Published | None, float]:
        """One Prefill call on `pnode` (in flight until its first token): (first token, published, TTFT
        from `t0`). Raises the call's `KVPoolError` (its message without the node)."""
        pending = True

        def end_prefill() -> None:
            nonlocal pending
            if pending:
                pending = False
                self.inflight.end(pnode.node.node_id, pnode.node.epoch, service_s)

        first: FirstToken | None = None
        published: Published | None = None
        ttft_s = 0.0
        try:
            for ev in self.node_client.prefill(pnode.node.grpc_address, req):
                if isinstance(ev, FirstToken):
                    ttft_s = time.perf_counter() - t0
                    first = ev
                    end_prefill()
                else:
                    published = ev
        finally:
            end_prefill()
        return first, published, ttft_s

    def record_first(self, choice: Choice, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's first token: its decision and every per-request figure a ratio is formed of, at one
        point for one set of requests (field case B40; definitions in `kvpool.router.metrics`)."""
        m = self.metrics
        m.decisions.labels(self.policy.policy, choice.node_id, "served").inc()
        m.ttft.observe(ttft_s)
        m.predicted_ttft.observe(choice.prediction.ttft_s)
        m.prompt_tokens.inc(prompt_tokens)
        m.cached_tokens.inc(cached_tokens)
        m.predicted_cached_tokens.inc(min(choice.prediction.reused_tokens, prompt_tokens))

    def generate(
        self, tokens: Sequence[int], sampling: SamplingParams, *, cache_salt: str = "", request_id: str = ""
    ) -> Generator[Event, None, None]:
        """Serve one admitted request: "first", then "tokens"*, then "done". Raises `KVPoolError`."""
        rid = request_id or uuid.uuid4().hex[:16]
        tokens = list(tokens)
        t0 = time.perf_counter()
        peeked = self.peek(tokens, cache_salt)
        req = PrefillRequest(request_id=rid, token_ids=tokens, sampling=sampling, cache_salt=cache_salt)
        tried: list[str] = []
        failure = ""
        choice: Choice | None = None
        try:
            while True:  # nothing reaches the client before the prefill ends: an unreachable node is retried
                choice, pnode = self.choose_prefill(peeked, tried)
                if failure:
                    log.warning("[%s] %s; retrying on %s", rid, failure, pnode.node.node_id)
                try:
                    first, published, ttft_s = self._prefill(pnode, choice.prediction.service_s, req, t0)
                    break
                except KVPoolError as exc:
                    failure = self._call_failed("prefill", pnode, exc, tried)
            self.node_answered(pnode)
            self.affinity.record(peeked.hashes, pnode)
            if first is None:
                raise Unavailable(f"prefill on {pnode.node.node_id} ended without a first token")
        except BaseException:
            if choice is not None:  # placed, never served: one decision, under the last node tried
                self.metrics.decisions.labels(self.policy.policy, choice.node_id, "failed").inc()
            raise
        cached = min(first.stats.num_reused_tokens, len(tokens))  # a node's report never passes the prompt
        self.record_first(choice, ttft_s, len(tokens), cached)
        log.debug(
            "[%s] prefill %s (%s, predicted %.3fs): prompt=%d cached=%d ttft=%.3fs",
            rid,
            pnode.node.node_id,
            self.policy.policy,
            choice.prediction.ttft_s,
            len(tokens),
            cached,
            ttft_s,
        )
        common: dict[str, Any] = {
            "prompt_tokens": len(tokens),
            "cached_tokens": cached,
            "prefill_node": pnode.node.node_id,
        }
        yield Event("first", token_ids=[first.token_id], ttft_s=ttft_s, **common)
        stop = set(sampling.stop_token_ids)
        if first.token_id in stop or sampling.max_tokens <= 1:
            self.metrics.completion_tokens.inc(1)
            reason = "stop" if first.token_id in stop else "length"
            yield Event("done", finish_reason=reason, ttft_s=ttft_s, **common)
            return
        dreq = DecodeRequest.handoff(req, first, published)
        n_out = 1
        t_first = time.perf_counter()
        tried = []
        failure = ""
        while True:
            dnode = self.pick_decode(tried)
            if failure:
                log.warning("[%s] %s; retrying on %s", rid, failure, dnode.node.node_id)
            reason = "length"
            self.decode_inflight.begin(dnode.node.node_id, dnode.node.epoch)
            try:
                for dev in self.node_client.decode(dnode.node.grpc_address, dreq):
                    if isinstance(dev, DecodeTokens):
                        n_out += len(dev.token_ids)
                        yield Event("tokens", token_ids=list(dev.token_ids))
                    elif isinstance(dev, Finished):
                        reason = dev.stats.finish_reason or reason
                break
            except KVPoolError as exc:
                if n_out > 1:  # this node's tokens went out: never retried
                    if isinstance(exc, Unavailable):
                        self.node_failed("decode", dnode)
                    raise type(exc)(f"decode on {dnode.node.node_id}: {exc}") from None
                failure = self._call_failed("decode", dnode, exc, tried)
            finally:
                self.decode_inflight.end(dnode.node.node_id, dnode.node.epoch)
        self.node_answered(dnode)
        self.metrics.completion_tokens.inc(n_out)
        if n_out > 1:
            self.metrics.tpot.observe((time.perf_counter() - t_first) / (n_out - 1))
        yield Event("done", finish_reason=reason, decode_node=dnode.node.node_id, ttft_s=ttft_s, **common)
