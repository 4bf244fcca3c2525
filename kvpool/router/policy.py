"""Routing policies: which prefill node serves a prompt.

Every policy sees the same picture, built per request from a peek at the global index (a match that
counts no hit and takes no lease) and the nodes' heartbeat reports:

- `RouteRequest`: the prompt length, the block geometry and how many leading blocks the pool holds;
- one `NodeState` per live prefill node: its reported `NodeLoad` (queue length, calibrated recompute
  model, link estimate), the leading blocks of this prompt in its own node-local tier, and the requests
  *this router* sent it that have not produced their first token yet (`inflight`, `inflight_s`).

The router's own in-flight count is what keeps the load term alive for paced requests (field case B21:
with heartbeats lagging, the reported queue is 0 at every decision, so a purely reported load lets one
warm node take everything). Ties are broken by a seeded random choice over the tied node ids in sorted
order, never by container order.

Policies:
- `cost` (default): predicted TTFT = queue wait + predicted service, the service being the cost model's
  best `load(k) + compute(rest)` for that node (`kvpool.cost.decide_reuse`): node-local blocks are free,
  pool blocks are pulled over the node's calibrated link, the rest is recomputed with its calibrated
  model. Queue wait = the predicted service of the requests this router has in flight there, plus, for
  any further requests the node reports queued (other routers' work), this prompt's service each.
- `affinity`: the node with the longest node-local prefix (pure prefix affinity; a baseline that
  overloads a node holding a hot prefix, kept for comparison).
- `least-load`: the fewest queued requests (own in-flight or reported, whichever is larger).
- `round-robin`: in turn over the sorted node ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.client.types import NodeLoad
from kvpool.cost import LinkEstimate, RecomputeModel, decide_reuse
from kvpool.errors import InvalidArgument, Unavailable
from kvpool.prompt import max_reusable_blocks

POLICIES = ("cost", "affinity", "least-load", "round-robin")

DEFAULT_RECOMPUTE = RecomputeModel(overhead_s=0.005, per_token_s=2e-4, per_pair_s=0.0, source="given")
"""Used for a node that has not reported a calibration yet (the same for every such node)."""

DEFAULT_LINK = LinkEstimate(alpha_s=0.001, beta_bytes_per_s=1e9)
"""Used for a node that has not reported a link estimate yet."""

COST_MARGIN = 0.1
"""The margin the serving nodes' connector applies to loads (`ServingSettings.cost_margin`)."""

_TIE_REL = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteRequest:
    """One prompt to place. `pool_blocks`: leading full blocks the pool holds (from the peek)."""

    prompt_len: int
    block_size: int
    block_nbytes: int
    pool_blocks: int = 0

    @property
    def max_reusable_blocks(self) -> int:
        """The prompt's last token is always computed (`kvpool.prompt.max_reusable_blocks`)."""
        return max_reusable_blocks(self.prompt_len, self.block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeState:
    """What the router knows about one prefill node when it places one request."""

    node_id: str
    epoch: int = 0
    load: NodeLoad = field(default_factory=NodeLoad)
    inflight: int = 0
    inflight_s: float = 0.0
    local_blocks: int = 0

    def recompute_model(self) -> RecomputeModel:
        ld = self.load
        model = RecomputeModel.from_heartbeat(
            ld.recompute_overhead_s, ld.recompute_s_per_token, ld.recompute_s_per_token_ctx
        )
        return DEFAULT_RECOMPUTE if model is None else model

    def link(self) -> LinkEstimate:
        ld = self.load
        if ld.link_beta_bytes_per_s <= 0:
            return DEFAULT_LINK
        return LinkEstimate(alpha_s=max(0.0, ld.link_alpha_s), beta_bytes_per_s=ld.link_beta_bytes_per_s)

    @property
    def queued(self) -> int:
        """Requests ahead of a new one: the larger of our own in-flight and the node's report."""
        return max(self.inflight, self.load.queue_len)


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """The cost model's view of one node for one prompt (seconds, tokens)."""

    node_id: str
    queue_s: float
    service_s: float
    reused_tokens: int
    local_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.service_s


def predict(req: RouteRequest, node: NodeState) -> Prediction:
    """Predicted TTFT of `req` on `node` (see the module docstring)."""
    h = min(req.pool_blocks, req.max_reusable_blocks)
    local = min(node.local_blocks, h)
    decision = decide_reuse(
        h,
        req.block_size,
        req.prompt_len,
        req.block_nbytes,
        node.link(),
        node.recompute_model(),
        num_local_blocks=local,
        margin=COST_MARGIN,
    )
    service = decision.predicted_total_s
    others = max(0, node.load.queue_len - node.inflight)
    return Prediction(
        node_id=node.node_id,
        queue_s=node.inflight_s + others * service,
        service_s=service,
        reused_tokens=decision.reused_tokens,
        local_tokens=local * req.block_size,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """A placement: the node, the policy, every candidate's score (lower is better) and the prediction."""

    node_id: str
    policy: str
    scores: dict[str, float]
    prediction: Prediction
    tied: int = 1


class RoutingPolicy:
    """Chooses a prefill node per request with one policy. Not thread-safe: callers serialise `choose`."""

    def __init__(self, policy: str = "cost", *, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise InvalidArgument(f"unknown routing policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.policy = policy
        self._rng = random.Random(seed)
        self._rr = 0

    def scores(self, req: RouteRequest, nodes: Sequence[NodeState]) -> dict[str, float]:
        """Each node's score for `req` under this policy (lower is better)."""
        if self.policy == "cost":
            return {n.node_id: predict(req, n).ttft_s for n in nodes}
        if self.policy == "affinity":
            cap = min(req.pool_blocks, req.max_reusable_blocks)
            return {n.node_id: -float(min(n.local_blocks, cap)) for n in nodes}
        if self.policy == "least-load":
            return {n.node_id: float(n.queued) for n in nodes}
        return {n.node_id: 0.0 for n in nodes}

    def choose(self, req: RouteRequest, nodes: Sequence[NodeState]) -> Choice:
        """The node for `req`; `Unavailable` when there is none."""
        if not nodes:
            raise Unavailable("no live prefill node")
        by_id = {n.node_id: n for n in nodes}
        scores = self.scores(req, nodes)
        ids = sorted(scores)
        if self.policy == "round-robin":
            pick, tied = ids[self._rr % len(ids)], 1
            self._rr += 1
        else:
            best = min(scores.values())
            tol = _TIE_REL * max(1.0, abs(best))
            candidates = [i for i in ids if scores[i] <= best + tol]
            pick, tied = self._rng.choice(candidates), len(candidates)
        return Choice(
            node_id=pick, policy=self.policy, scores=scores, prediction=predict(req, by_id[pick]), tied=tied
        )
