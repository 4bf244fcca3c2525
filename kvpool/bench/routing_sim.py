"""Discrete-event simulation of prefill routing (`kvpool bench routing`, mode "sim").

What is real, what is measured and what is modelled:
- **Real**: the router's placement code (`kvpool.router.state.node_states` on a peek, `Inflight`,
  `kvpool.router.policy.RoutingPolicy`), the global index (`kvpool.index.RadixIndex` with the master's
  default eviction policy) and the node's load decision (`kvpool.cost.decide_reuse`, the same call a
  prefill node's connector makes, with the calibration the node reports).
- **Measured**: the service times. Each prefill node is one FIFO server. When a request reaches the head
  of its queue the node matches the pool (`count_hit=True`), takes its node-local tier's leading run, and
  `decide_reuse` picks what to load; the service time is then the **measured** TTFT of a prompt of that
  length with that many tokens loaded (locally or pulled), interpolated in a table recorded on a real
  prefill node (`kvpool.bench.routing_service.ServiceTimes`, `SimConfig.service`), times a lognormal
  factor whose sigma is the spread of that table's repetitions. The cost model's own prediction
  (`predicted_total_s`) only drives the router's bookkeeping (`Inflight`), never the service time: the
  `cost` policy is graded against measurements, not against the model it scores with.
- **Modelled**: one request at a time per node; the request's first token ends its service (TTFT = end
  − arrival); then its full blocks are published into the pool (the index, evicted down to
  `pool_capacity_frac` of the trace's unique blocks) and into the node's local tier (an LRU of
  `local_capacity_frac` of them), whose stored/evicted blocks become/leave `local` locations in the index
  as the master records them. Heartbeats report no queue (one router: its own in-flight count is the
  whole load, DESIGN B21).

Workload (`kvpool.bench.routing_workload`): a Mooncake-format trace (`kvpool.trace.load_trace`). Each hash
id is one block of `block_tokens` tokens (the table's block size, 32: the embedded model's 32K-token
context holds the trace's longest prompt at that scale; the trace's own 512 would not fit); only full
blocks are published, as the live system does. Requests sharing a quantised timestamp are spread evenly
up to the next distinct timestamp. Timestamps are then scaled so that the **cold demand** (every prompt
recomputed in full, the table's measured cold TTFT) is `load` × `num_nodes` node-seconds per second: the
same offered load per node for every node count and every policy. Reuse makes the real utilisation lower
(each record reports it: busy node-seconds / (nodes × makespan)). `time_scale` (simulated seconds per
trace second) is recorded.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.bench.routing_service import ServiceTimes
from kvpool.bench.routing_workload import SimProfile, Workload
from kvpool.cost import decide_reuse
from kvpool.errors import InvalidArgument, NotFound
from kvpool.index import DEFAULT_POLICY, RadixIndex
from kvpool.prompt import max_reusable_blocks
from kvpool.router.policy import COST_MARGIN, RouteRequest, RoutingPolicy
from kvpool.router.state import Inflight, node_states
from kvpool.types import BlockHash, FakeClock, Location, Match, NamespaceId, NodeInfo, NodeStatus

_NS = NamespaceId(b"routing-sim-ns\x00\x00")
_POOL_LOC = Location("store0", 0, 0)
_EPOCH = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """One simulated cluster. `profile`: the calibration the nodes report (what the router and the load
    decision score with); `service`: the measured service times. Capacities are fractions of the
    workload's unique full blocks."""

    policy: str
    num_nodes: int
    profile: SimProfile
    service: ServiceTimes
    pool_capacity_frac: float = 0.1
    local_capacity_frac: float = 0.01
    seed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """Per request (arrival order): TTFT (s) and the node; per node: prompt and computed tokens."""

    policy: str
    num_nodes: int
    ttft_s: tuple[float, ...]
    node_of: tuple[int, ...]
    prompt_tokens: int
    reused_tokens: int
    local_tokens: int
    """Reused tokens that came from the serving node's own local tier (the rest were pulled)."""
    computed_tokens_per_node: tuple[int, ...]
    utilization: float
    """Busy node-seconds / (nodes x makespan): the load the nodes really carried."""

    def record(self) -> dict[str, Any]:
        """The issue-#11 record: `mode`, `policy`, p50/p90 TTFT, token hit rate, imbalance (+ extras)."""
        rec = ttft_record(
            "sim",
            self.policy,
            self.num_nodes,
            self.ttft_s,
            self.prompt_tokens,
            self.reused_tokens,
            self.computed_tokens_per_node,
        )
        rec["local_hit_rate"] = (
            round(self.local_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0
        )
        rec["utilization"] = round(self.utilization, 4)
        return rec


def ttft_record(
    mode: str,
    policy: str,
    num_nodes: int,
    ttft_s: Any,
    prompt_tokens: int,
    reused_tokens: int,
    computed_per_node: Any,
) -> dict[str, Any]:
    """imbalance = max / mean computed (prefilled) tokens per node (1 = even; `num_nodes` = one node)."""
    t = np.asarray(ttft_s, dtype=float)
    work = np.asarray(computed_per_node, dtype=float)
    return {
        "mode": mode,
        "policy": policy,
        "num_nodes": num_nodes,
        "num_requests": int(t.size),
        "p50_ttft_s": round(float(np.percentile(t, 50)), 4),
        "p90_ttft_s": round(float(np.percentile(t, 90)), 4),
        "p99_ttft_s": round(float(np.percentile(t, 99)), 4),
        "mean_ttft_s": round(float(t.mean()), 4),
        "token_hit_rate": round(reused_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        "imbalance": round(float(work.max() / work.mean()), 4) if work.sum() > 0 else 1.0,
    }


@dataclass(slots=True)
class _Node:
    node_id: str
    local_capacity: int
    queue: list[int] = field(default_factory=list)
    busy: bool = False
    local: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)
    computed_tokens: int = 0


class _Sim:
    def __init__(self, wl: Workload, cfg: SimConfig) -> None:
        if cfg.num_nodes < 1:
            raise InvalidArgument("num_nodes must be >= 1")
        self.wl, self.cfg, p = wl, cfg, cfg.profile
        self.block_nbytes = wl.block_tokens * p.kv_bytes_per_token
        self.clock = FakeClock(0)
        self.index = RadixIndex(clock=self.clock, policy=DEFAULT_POLICY)
        self.index.register_namespace(_NS)
        self.pool_capacity = max(1, round(cfg.pool_capacity_frac * wl.num_unique_blocks))
        local_cap = round(cfg.local_capacity_frac * wl.num_unique_blocks)
        self.nodes = [_Node(f"prefill{i:02d}", local_cap) for i in range(cfg.num_nodes)]
        infos = [NodeInfo(n.node_id, "prefill", "sim", "", _EPOCH) for n in self.nodes]
        self.infos = {i.node_id: i for i in infos}
        load = p.node_load()
        self.statuses = [NodeStatus(i, True, False, 0, 0, 0, 0, load) for i in infos]
        self.policy = RoutingPolicy(cfg.policy, seed=cfg.seed)
        self.inflight = Inflight()
        rng = np.random.default_rng(cfg.seed)  # the same draws for every policy (common random numbers)
        sigma = cfg.service.noise_sigma
        self.noise = np.exp(sigma * rng.standard_normal(len(wl.requests)) - sigma**2 / 2)
        self.ttft = [0.0] * len(wl.requests)
        self.node_of = [0] * len(wl.requests)
        self.predicted = [0.0] * len(wl.requests)
        self.prompt_tokens = self.reused_tokens = self.local_tokens = 0
        self.busy_s = 0.0

    def run(self) -> SimResult:
        events: list[tuple[float, int, int, int]] = []  # (time, 0 = done / 1 = arrival, seq, payload)
        for i, r in enumerate(self.wl.requests):
            heapq.heappush(events, (r.arrival_s, 1, i, i))
        now = 0.0
        while events:
            now, kind, _, i = heapq.heappop(events)
            self.clock.set(max(self.clock.now_ms(), int(now * 1000)))
            if kind == 1:
                k = self._route(i)
                node = self.nodes[k]
                node.queue.append(i)
                if not node.busy:
                    self._start(k, now, events)
            else:
                k = self.node_of[i]
                self.ttft[i] = now - self.wl.requests[i].arrival_s
                self.inflight.end(self.nodes[k].node_id, _EPOCH, self.predicted[i])
                self._publish(k, i)
                self.nodes[k].busy = False
                if self.nodes[k].queue:
                    self._start(k, now, events)
        return SimResult(
            policy=self.cfg.policy,
            num_nodes=self.cfg.num_nodes,
            ttft_s=tuple(self.ttft),
            node_of=tuple(self.node_of),
            prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused_tokens,
            local_tokens=self.local_tokens,
            computed_tokens_per_node=tuple(n.computed_tokens for n in self.nodes),
            utilization=self.busy_s / (len(self.nodes) * max(now, 1e-9)),
        )

    def _route(self, i: int) -> int:
        """The router's `place` (kvpool.router.service), minus hashing and gRPC: peek, states, choose."""
        req = self.wl.requests[i]
        bs = self.wl.block_tokens
        max_blocks = max_reusable_blocks(req.prompt_len, bs)
        res = self.index.match_prefix(_NS, req.hashes[:max_blocks], count_hit=False, lease_ttl_ms=0)
        match = None
        if res.num_matched:
            names = {loc.node_id for locs in res.locations for loc in locs if loc.local}
            match = Match(res.num_matched, res.locations, None, {n: self.infos[n] for n in names})
        route = RouteRequest(
            prompt_len=req.prompt_len,
            block_size=bs,
            block_nbytes=self.block_nbytes,
            pool_blocks=res.num_matched,
        )
        states = node_states(self.statuses, match, self.inflight, max_blocks)
        choice = self.policy.choose(route, states)
        k = int(choice.node_id.removeprefix("prefill"))
        self.node_of[i] = k
        self.predicted[i] = choice.prediction.service_s
        self.inflight.begin(choice.node_id, _EPOCH, choice.prediction.service_s)
        return k

    def _start(self, k: int, now: float, events: list[tuple[float, int, int, int]]) -> None:
        """The head of node k's queue starts: match (counted), local run, the connector's decision."""
        node = self.nodes[k]
        i = node.queue.pop(0)
        node.busy = True
        req, bs, p = self.wl.requests[i], self.wl.block_tokens, self.cfg.profile
        max_blocks = max_reusable_blocks(req.prompt_len, bs)
        cand = req.hashes[:max_blocks]
        num_pool = self.index.match_prefix(_NS, cand, count_hit=True, lease_ttl_ms=0).num_matched
        num_local = 0
        while num_local < len(cand) and cand[num_local] in node.local:
            num_local += 1
        h = max(num_pool, num_local)
        dec = decide_reuse(
            h,
            bs,
            req.prompt_len,
            self.block_nbytes,
            p.link,
            p.recompute,
            num_local_blocks=min(num_local, h),
            margin=COST_MARGIN,
        )
        for bh in cand[: dec.num_local_used]:
            node.local.move_to_end(bh)
        self.prompt_tokens += req.prompt_len
        self.reused_tokens += dec.reused_tokens
        local_tokens = min(dec.reused_tokens, dec.num_local_used * bs)
        self.local_tokens += local_tokens
        node.computed_tokens += dec.computed_tokens
        service_s = self.cfg.service.service_s(req.prompt_len, dec.reused_tokens, local_tokens) * float(
            self.noise[i]
        )
        self.busy_s += service_s
        heapq.heappush(events, (now + service_s, 0, i, i))

    def _publish(self, k: int, i: int) -> None:
        """After the first token: full blocks into the pool (then evict) and into node k's local tier."""
        hashes, node = self.wl.requests[i].hashes, self.nodes[k]
        if not hashes:
            return
        nbytes = self.block_nbytes
        self.index.insert(_NS, hashes, parent=None, locations=[(_POOL_LOC,)] * len(hashes), size_bytes=nbytes)
        over = self.index.num_blocks - self.pool_capacity
        if over > 0:
            self.index.evict(over)
        loc = Location(node.node_id, 0, 0, local=True)
        if node.local_capacity <= 0:
            return
        for bh in hashes:
            node.local[bh] = None
            node.local.move_to_end(bh)
        while len(node.local) > node.local_capacity:
            gone, _ = node.local.popitem(last=False)
            self._note_local(gone, loc, stored=False)
        for bh in hashes:
            if bh in node.local:
                self._note_local(bh, loc, stored=True)

    def _note_local(self, bh: BlockHash, loc: Location, *, stored: bool) -> None:
        """`Master.report_local`: a stored block gains a local location (if the pool holds it)."""
        try:
            if stored:
                self.index.add_location(_NS, bh, loc)
            else:
                self.index.remove_location(_NS, bh, loc)
        except NotFound:
            pass


def simulate(workload: Workload, cfg: SimConfig) -> SimResult:
    """Run `workload` through one simulated cluster (deterministic for a given `cfg.seed`)."""
    if not workload.requests:
        raise InvalidArgument("empty workload")
    if math.isnan(cfg.pool_capacity_frac) or cfg.pool_capacity_frac <= 0:
        raise InvalidArgument("pool_capacity_frac must be > 0")
    return _Sim(workload, cfg).run()
