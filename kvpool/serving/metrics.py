"""A serving node's Prometheus metrics (`kvpool_prefill_…` or `kvpool_decode_…`), one registry per node.

Per request: prompt tokens (the hit-rate denominator), reused tokens by source (`local`: the node-local
tier, `pulled`: the pool), the load decision (`none` | `local` | `pull` | `recompute`), the pull time, and
the role's latency (`LatencyMetric`: TTFT for prefill, TPOT for decode). Per link (`peer` = a store node's data address): blocks, bytes and
batch latency of reads (pulls) and writes (publishes), counted by `MeteredTransport`, the transport the
node's connector and pool client are given. The queue length is read at scrape time, and so is the
pool breaker's state (`kvpool.connector.breaker`): `…_pool_degraded` (1 while the node runs degraded:
node-local tier + recompute, no pool calls), `…_pool_degraded_since_seconds` (Unix time it began; 0
when not degraded) and `…_pool_calls_skipped_total` (requests that skipped the pool meanwhile).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.metrics import LATENCY_BUCKETS_S

if TYPE_CHECKING:
    from transfer import BlockRead, BlockResult, BlockWrite, LinkEstimate, Transport

DECISIONS = ("none", "local", "pull", "recompute")


class _BreakerCollector(Collector):
    """The pool breaker's state at scrape time."""

    def __init__(self, prefix: str, breaker: Any) -> None:
        self.prefix, self.breaker = prefix, breaker

    def collect(self) -> Iterator[Metric]:
        b, p = self.breaker, self.prefix
        yield GaugeMetricFamily(
            p + "pool_degraded",
            "1 while the node runs degraded (node-local tier + "
            "recompute, no pool calls; one probe per interval).",
            value=float(b.degraded),
        )
        yield GaugeMetricFamily(
            p + "pool_degraded_since_seconds",
            "Unix time the node's degraded mode began (0: not degraded).",
            value=b.degraded_since_unix_s,
        )
        yield CounterMetricFamily(
            p + "pool_calls_skipped",
            "Pool calls skipped in degraded mode (requests served from the node-local tier + recompute).",
            value=b.num_skipped,
        )


@dataclass(frozen=True, slots=True)
class LatencyMetric:
    """A role's per-request latency histogram: `name` after `kvpool_<role>_` (e.g. `ttft_seconds`) and its
    help text. Each role declares its own (prefill: TTFT, decode: TPOT)."""

    name: str
    help: str


class ServingMetrics:
    """Counters of one prefill or decode node; `role` is the metric-name prefix after `kvpool_`, `latency`
    the role's latency histogram (None: none is recorded)."""

    def __init__(self, role: str, latency: LatencyMetric | None = None) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r, p = self.registry, f"kvpool_{role}_"
        self.requests = Counter(
            p + "requests", "Requests served (first token sent / stream finished).", registry=r
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens",
            "Prompt tokens of served requests, recorded with reused_tokens per request: the hit-rate "
            "denominator (hit rate = reused_tokens_total summed over sources / prompt_tokens_total).",
            registry=r,
        )
        self.reused_tokens = Counter(
            p + "reused_tokens",
            "Prompt tokens taken from cache, by source (local tier or pulled), recorded "
            "with prompt_tokens for the same requests; at most their prompt tokens.",
            ["source"],
            registry=r,
        )
        self.decisions = Counter(p + "decisions", "Prompt KV load decisions.", ["decision"], registry=r)
        self.pulled_bytes = Counter(p + "pulled_bytes", "Bytes of blocks pulled from the pool.", registry=r)
        self.pull_seconds = Histogram(
            p + "pull_seconds",
            "Time to pull a request's blocks (requests that pulled).",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.link_blocks = Counter(
            p + "link_blocks",
            "Blocks moved per link and direction (ok or not).",
            ["peer", "op", "ok"],
            registry=r,
        )
        self.link_bytes = Counter(
            p + "link_bytes",
            "Bytes of blocks moved intact per link and direction.",
            ["peer", "op"],
            registry=r,
        )
        self.link_seconds = Histogram(
            p + "link_seconds",
            "Latency of one batched read or write per link.",
            ["peer", "op"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_len = Gauge(p + "queue_length", "Requests waiting or running on this node.", registry=r)
        self.latency = (
            Histogram(p + latency.name, latency.help, buckets=LATENCY_BUCKETS_S, registry=r)
            if latency is not None
            else None
        )

    def watch_breaker(self, breaker: Any) -> None:
        """Read `breaker`'s (a `PoolBreaker`) state at scrape time (the module docstring's three metrics)."""
        self.registry.register(_BreakerCollector(f"kvpool_{self.role}_", breaker))

    def set_queue_len(self, fn: Callable[[], int]) -> None:
        """Read the queue length from `fn` at scrape time."""
        self.queue_len.set_function(fn)

    def observe_request(
        self,
        *,
        num_prompt_tokens: int,
        num_reused_tokens: int,
        num_pulled_tokens: int,
        decision: str,
        pulled_bytes: int,
        pull_s: float,
        latency_s: float | None,
    ) -> None:
        """One served request. `latency_s`: the role's latency (None: not observed, e.g. the TPOT of a
        one-token answer)."""
        self.requests.inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.reused_tokens.labels("pulled").inc(num_pulled_tokens)
        self.reused_tokens.labels("local").inc(max(0, num_reused_tokens - num_pulled_tokens))
        self.decisions.labels(decision if decision in DECISIONS else "none").inc()
        self.pulled_bytes.inc(pulled_bytes)
        if num_pulled_tokens > 0 or pulled_bytes > 0:
            self.pull_seconds.observe(pull_s)
        if latency_s is not None and self.latency is not None:
            self.latency.observe(latency_s)


class MeteredTransport:
    """A `transfer.Transport` that forwards to `inner` and records per-peer blocks, bytes and latency."""

    def __init__(self, inner: Transport, metrics: ServingMetrics) -> None:
        self._inner = inner
        self._m = metrics

    def _record(
        self, peer: str, op: str, nbytes: Sequence[int], results: Sequence[BlockResult], elapsed_s: float
    ) -> None:
        m = self._m
        m.link_seconds.labels(peer, op).observe(elapsed_s)
        num_ok = sum(1 for r in results if r.ok)
        m.link_blocks.labels(peer, op, "true").inc(num_ok)
        m.link_blocks.labels(peer, op, "false").inc(len(results) - num_ok)
        m.link_bytes.labels(peer, op).inc(sum(n for n, r in zip(nbytes, results, strict=False) if r.ok))

    def read_blocks(
        self, peer: str, reads: Sequence[BlockRead], out: Sequence[memoryview], **kwargs: Any
    ) -> list[BlockResult]:
        t0 = time.perf_counter()
        results = self._inner.read_blocks(peer, reads, out, **kwargs)
        self._record(peer, "read", [r.nbytes for r in reads], results, time.perf_counter() - t0)
        return results

    def write_blocks(self, peer: str, writes: Sequence[BlockWrite], **kwargs: Any) -> list[BlockResult]:
        t0 = time.perf_counter()
        results = self._inner.write_blocks(peer, writes, **kwargs)
        self._record(peer, "write", [_nbytes(w) for w in writes], results, time.perf_counter() - t0)
        return results

    def link(self, peer: str) -> LinkEstimate:
        return self._inner.link(peer)

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _nbytes(write: BlockWrite) -> int:
    data = write.data
    return int(getattr(data, "nbytes", None) or len(data))
