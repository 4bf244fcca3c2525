"""The routing simulation's inputs (`kvpool.bench.routing_sim`): the calibrated node profiles
(`SimProfile`: the recompute model and link the nodes report, which the router and the load decision
score with; the service times are measured, `kvpool.bench.routing_service`) and the workload built from a
Mooncake-format trace (`build_workload`: one block of `block_tokens` tokens per hash id, arrivals spread
and scaled so that the cold demand is `load` x `num_nodes` node-seconds per second)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpool.cost import LinkEstimate, RecomputeModel
from kvpool.errors import InvalidArgument
from kvpool.trace import TRACE_BLOCK_TOKENS, Trace
from kvpool.types import BlockHash, NodeLoad


@dataclass(frozen=True, slots=True, kw_only=True)
class SimProfile:
    """A serving node's calibration: recompute model, KV bytes per token, link to the pool, fit noise."""

    name: str
    recompute: RecomputeModel
    kv_bytes_per_token: int
    link: LinkEstimate
    source: str

    def node_load(self) -> NodeLoad:
        """What a node with this calibration reports in its heartbeats (queue 0, see module docstring)."""
        r = self.recompute
        return NodeLoad(
            queue_len=0,
            recompute_s_per_token=r.per_token_s,
            recompute_s_per_token_ctx=r.per_pair_s,
            recompute_overhead_s=r.overhead_s,
            link_alpha_s=self.link.alpha_s,
            link_beta_bytes_per_s=self.link.beta_bytes_per_s,
        )


EMBEDDED_CPU = SimProfile(
    name="embedded-cpu",
    recompute=RecomputeModel(
        overhead_s=0.004602,
        per_token_s=9.885e-5,
        per_pair_s=1.1958e-7,
        source="calibrated",
        fit_rel_rmse=0.106,
        num_samples=9,
    ),
    kv_bytes_per_token=4096,
    link=LinkEstimate(alpha_s=0.001, beta_bytes_per_s=0.58e9),
    source=(
        "kvpool.model.calibrate.calibrate_recompute of the embedded default model (4 layers, hidden 256, "
        "fp32) on the 2-core x86_64 VM (default grid, 9 samples, rel. RMSE 10.6 %); KV 4096 B/token; "
        "link 1 ms + 0.58 GB/s (README: UCX tcp, 1 MiB reads between two processes)"
    ),
)


LLAMA3_8B_H100 = SimProfile(
    name="llama3-8b-h100",
    recompute=RecomputeModel.from_flops(
        flop_params=7_000_000_000, num_layers=32, attn_dim=4096, flops_per_s=400e12, overhead_s=0.010
    ),
    kv_bytes_per_token=32 * 2 * 8 * 128 * 2,
    link=LinkEstimate(alpha_s=0.001, beta_bytes_per_s=25e9),
    source=(
        "FLOP model (RecomputeModel.from_flops): Llama-3-8B decoder (7e9 matmul params, 32 layers, 4096 "
        "attention dim) at 400 TFLOP/s, 10 ms overhead; bf16 KV 128 KiB/token; link 1 ms + 25 GB/s "
        "(one 200 Gb/s RDMA NIC); no fit error known (noise 0)"
    ),
)


PROFILES = {p.name: p for p in (EMBEDDED_CPU, LLAMA3_8B_H100)}


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One arrival: time (s), prompt length (tokens) and the hashes of its full blocks."""

    arrival_s: float
    prompt_len: int
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """Requests in arrival order; `time_scale` = simulated seconds per trace second."""

    name: str
    requests: tuple[SimRequest, ...]
    block_tokens: int
    num_unique_blocks: int
    time_scale: float
    load: float


def block_hash(hash_id: int) -> BlockHash:
    return BlockHash(hash_id.to_bytes(16, "big"))


def spread_arrivals_s(timestamps_ms: list[int]) -> list[float]:
    """Trace seconds per request: requests sharing a timestamp spread evenly up to the next one."""
    distinct = sorted(set(timestamps_ms))
    if len(distinct) > 1:
        gaps = [b - a for a, b in zip(distinct, distinct[1:], strict=False)]
        nxt = dict(zip(distinct, distinct[1:] + [distinct[-1] + sum(gaps) / len(gaps)], strict=True))
    else:
        nxt = {distinct[0]: distinct[0] + 1000.0}
    counts: dict[int, int] = {}
    for ts in timestamps_ms:
        counts[ts] = counts.get(ts, 0) + 1
    seen: dict[int, int] = {}
    out = []
    for ts in timestamps_ms:
        j = seen.get(ts, 0)
        seen[ts] = j + 1
        out.append((ts + (nxt[ts] - ts) * j / counts[ts]) / 1000.0)
    return out


def build_workload(
    trace: Trace,
    profile: SimProfile,
    *,
    num_nodes: int,
    load: float,
    block_tokens: int = TRACE_BLOCK_TOKENS,
    max_requests: int | None = None,
    cold_s: Callable[[int], float] | None = None,
) -> Workload:
    """Arrivals scaled so the cold demand is `load` x `num_nodes` (see the module docstring). `cold_s`:
    a prompt's cold service time (s) from its length in tokens (default: the profile's recompute model;
    the benchmark passes the measured `ServiceTimes.cold_s`)."""
    if num_nodes < 1 or not load > 0 or block_tokens < 1:
        raise InvalidArgument("num_nodes >= 1, load > 0 and block_tokens >= 1 are required")
    reqs = trace.requests[:max_requests] if max_requests else trace.requests
    arrivals = spread_arrivals_s([r.timestamp_ms for r in reqs])
    seen: set[int] = set()
    cold_total_s, out = 0.0, []
    for r in reqs:
        prompt_len = max(1, round(r.input_length * block_tokens / TRACE_BLOCK_TOKENS))
        ids = r.hash_ids[: prompt_len // block_tokens]
        cold_total_s += cold_s(prompt_len) if cold_s else profile.recompute.t_recompute_s(prompt_len, 0)
        seen.update(ids)
        out.append((prompt_len, tuple(block_hash(i) for i in ids)))
    span_s = max(arrivals[-1] - arrivals[0], 1e-9)
    span_s *= len(reqs) / max(1, len(reqs) - 1)  # one mean gap more: the last request's share
    scale = cold_total_s / (load * num_nodes) / span_s
    t0 = arrivals[0]
    requests = tuple(SimRequest((t - t0) * scale, n, h) for t, (n, h) in zip(arrivals, out, strict=True))
    return Workload(
        name=trace.name,
        requests=requests,
        block_tokens=block_tokens,
        num_unique_blocks=len(seen),
        time_scale=scale,
        load=load,
    )
