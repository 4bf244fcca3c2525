"""The router's Prometheus metrics (one registry per router, so tests may run several in one process).

Definitions (field case B40: every ratio a dashboard forms divides counters recorded at the same point
of a request's life, for the same set of requests):

- **Requests, not attempts.** `kvpool_router_routing_decisions_total{policy,node,outcome}` counts each
  placed request once: `outcome="served"` under the prefill node that gave its first token, `"failed"`
  under the last node tried when none did. A retry on another node after its node could not be reached
  is no second decision: it is counted in `kvpool_router_retries_total{role}` (prefill attempts =
  decisions + prefill retries).
- **One point, one set.** At a request's first token, and only then, the router records together:
  `kvpool_router_ttft_seconds` (measured), `kvpool_router_predicted_ttft_seconds` (the cost model's
  prediction for the node that served it), `kvpool_router_prompt_tokens_total`,
  `kvpool_router_cached_tokens_total` (reused by that node: OpenAI `cached_tokens`) and
  `kvpool_router_predicted_cached_tokens_total` (what placement expected that node to reuse). So
  predicted vs actual TTFT compares histograms of the same requests (their `_count`s are equal, and
  equal `routing_decisions_total{outcome="served"}`), and hit rate =
  `cached_tokens_total / prompt_tokens_total` ≤ 1 (a node's report is clamped to the prompt).
- The master's `kvpool_master_hit_tokens_total / kvpool_master_requested_tokens_total` is another figure:
  tokens *matched* (on offer in the pool) per counted match, not tokens reused; a serving node's
  `kvpool_prefill_reused_tokens_total / kvpool_prefill_prompt_tokens_total` is the router's hit rate
  seen from the nodes (the same requests, when this router is the nodes' only client).
- **Degraded parts.** `kvpool_router_master_reachable` is 1 while the last call to the master answered,
  0 from the first failed one; `kvpool_router_degraded_since_seconds{part}` has one series per degraded
  part ("master", or "<role> <node id>" for a node in back-off) whose value is the Unix time it became
  degraded (no series while none is). `kvpool_router_unpeeked_requests_total` counts requests placed
  without a peek at the master's index (the master unreachable: on the router's own affinity record).
- **Tenants by opaque id.** `kvpool_router_tenant_inflight_requests{tenant}` and
  `kvpool_router_tenant_rejected_total{tenant}` (429s of `max_inflight_per_tenant`) label a tenant by
  `kvpool.tenants.tenant_id`, a short digest of its keyed salt: no metric names a tenant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_AT_FIRST = (
    "Recorded once per request at its first token (the same requests as every kvpool_router_*tokens_total)."
)


class _DegradedCollector(Collector):
    """Reads the router's degraded parts at each scrape (set by `RouterMetrics.watch_degraded`)."""

    def __init__(self) -> None:
        self.parts: Callable[[], list[Any]] = list
        self.master_up: Callable[[], bool] = lambda: True

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "kvpool_router_master_reachable",
            "1 while the router's last call to the master answered, 0 from the first failed one.",
            value=1.0 if self.master_up() else 0.0,
        )
        since = GaugeMetricFamily(
            "kvpool_router_degraded_since_seconds",
            "Unix time each degraded part (the master, a node in back-off) became degraded; no series "
            "while none is.",
            labels=["part"],
        )
        for p in self.parts():
            since.add_metric([p.part], p.since_unix_s)
        yield since


class RouterMetrics:
    """The router's counters, histograms and gauges (see the module docstring for the definitions)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvpool_router_requests",
            "HTTP API requests by endpoint and status code (once per request).",
            ["endpoint", "code"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvpool_router_prompt_tokens",
            "Prompt tokens of requests that got a first token: the one denominator of the router's token "
            f"ratios (hit rate = cached_tokens_total / prompt_tokens_total). {_AT_FIRST}",
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvpool_router_cached_tokens",
            "Prompt tokens the serving prefill node reused from cache (node-local or pulled; OpenAI "
            f"cached_tokens), at most the prompt's. {_AT_FIRST}",
            registry=r,
        )
        self.predicted_cached_tokens = Counter(
            "kvpool_router_predicted_cached_tokens",
            "Prompt tokens placement predicted the serving node would reuse (cost model), at most the "
            f"prompt's. {_AT_FIRST}",
            registry=r,
        )
        self.completion_tokens = Counter("kvpool_router_completion_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(
            "kvpool_router_ttft_seconds",
            f"Time to first token as the router sees it, from arrival, retries included (s). {_AT_FIRST}",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvpool_router_tpot_seconds",
            "Mean time per output token after the first, per request (s).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.decisions = Counter(
            "kvpool_router_routing_decisions",
            "Prefill placements, once per request (retries: kvpool_router_retries_total), by policy, node "
            "and outcome: served (the node that gave the first token) or failed (the last node tried).",
            ["policy", "node", "outcome"],
            registry=r,
        )
        self.predicted_ttft = Histogram(
            "kvpool_router_predicted_ttft_seconds",
            f"The cost model's predicted TTFT of the node that served the request (s). {_AT_FIRST}",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("kvpool_router_inflight_requests", "Requests being served now.", registry=r)
        self.node_failures = Counter(
            "kvpool_router_node_failures",
            "Calls to a prefill/decode node that could not reach it (UNAVAILABLE): the node went into back-off.",
            ["role", "node"],
            registry=r,
        )
        self.retries = Counter(
            "kvpool_router_retries",
            "Attempts beyond a request's first on a role: retries on another node after a call could not "
            "reach its node (UNAVAILABLE). Attempts = requests + retries.",
            ["role"],
            registry=r,
        )
        self.rejected = Counter(
            "kvpool_router_rejected", "Requests refused before routing, by reason.", ["reason"], registry=r
        )
        self.tenant_inflight = Gauge(
            "kvpool_router_tenant_inflight_requests",
            "Requests in flight per tenant (its opaque id), from their headers to their last byte out.",
            ["tenant"],
            registry=r,
        )
        self.tenant_rejected = Counter(
            "kvpool_router_tenant_rejected",
            "Requests refused 429 by max_inflight_per_tenant, per tenant (its opaque id).",
            ["tenant"],
            registry=r,
        )
        self.unpeeked = Counter(
            "kvpool_router_unpeeked_requests",
            "Requests placed without a peek at the master's index (the master unreachable): on the "
            "router's own record of where recent prefixes went.",
            registry=r,
        )
        self._degraded = _DegradedCollector()
        r.register(self._degraded)
        self.namespace_entries = Gauge(
            "kvpool_router_namespace_cache_entries",
            "Cache salts whose namespace digest the router keeps (at most namespace_cache_size).",
            registry=r,
        )
        self.namespace_evictions = Counter(
            "kvpool_router_namespace_cache_evictions",
            "Namespace digests dropped for namespace_cache_size (recomputed on their salt's next request).",
            registry=r,
        )

    def watch_degraded(self, parts: Callable[[], list[Any]], master_up: Callable[[], bool]) -> None:
        """Scrapes read `parts()` (`kvpool.router.degraded.DegradedPart`s) and `master_up()`."""
        self._degraded.parts, self._degraded.master_up = parts, master_up
