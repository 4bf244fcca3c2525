"""The router's Prometheus metrics (one registry per router, so tests may run several in one process).

Hit rate = `kvpool_router_cached_tokens_total / kvpool_router_prompt_tokens_total` (the denominator is
explicit: every prompt token of every served request).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvpool_router_requests", "HTTP API requests by endpoint and status code.", ["endpoint", "code"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "kvpool_router_prompt_tokens", "Prompt tokens of served requests (the hit-rate denominator).",
            registry=r,
        )  # fmt: skip
        self.cached_tokens = Counter(
            "kvpool_router_cached_tokens",
            "Prompt tokens reused from cache (node-local or pulled).",
            registry=r,
        )
        self.completion_tokens = Counter("kvpool_router_completion_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(
            "kvpool_router_ttft_seconds", "Time to first token, as the router sees it.", buckets=_TTFT_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "kvpool_router_tpot_seconds", "Mean time per output token after the first, per request.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "kvpool_router_routing_decisions", "Prefill placements by policy and node.", ["policy", "node"],
            registry=r,
        )  # fmt: skip
        self.predicted_ttft = Histogram(
            "kvpool_router_predicted_ttft_seconds", "The chosen node's predicted TTFT (cost model).",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.inflight = Gauge("kvpool_router_inflight_requests", "Requests being served now.", registry=r)
        self.node_failures = Counter(
            "kvpool_router_node_failures",
            "Calls to a prefill/decode node that could not reach it (UNAVAILABLE): the node went into back-off.",
            ["role", "node"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "kvpool_router_retries", "Requests retried on another node after their node could not be reached.",
            ["role"], registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            "kvpool_router_rejected", "Requests refused before routing, by reason.", ["reason"], registry=r
        )
