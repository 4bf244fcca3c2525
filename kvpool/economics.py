"""Hit-rate economics: prefill tokens, FLOP and GPUs a KV pool saves (`kvpool admin economics`, `kvpool
bench economics`).

Definitions (docs/design.md "Why it pays"):
  - λ: requests per second; h: the share of requests that reuse anything (reused tokens > 0);
    s_c: the mean reused tokens of those requests. Then
        saved prefill tokens/s  S = λ · h · s_c            (= λ · mean reused tokens per request)
    so a hit is counted once: h counts requests, s_c tokens per hitting request. From live counters the
    master gives hit tokens directly, so S = Δhit_tokens / Δt (h and s_c are not separable there).
  - FLOP a reused prefix of s tokens would have cost (Kaplan et al. 2020, arXiv 2001.08361: 2Ψ FLOP per
    token for the dense weights; attention counted exactly, QKᵀ and AV = 4·d_attn FLOP per layer per
    (query, key) pair, causal: s(s+1)/2 pairs):
        F(s) = 2Ψ·s + 4·n_layers·d_attn·s(s+1)/2
    FLOP/s saved = λ·h·F(s_c) from the means (a lower bound: F is convex; the table over h uses it), or
    Σ F(s_i) / duration exactly in a trace replay (the measured row, its share and its verdict).
  - GPUs saved = FLOP/s saved ÷ (peak FLOP/s · MFU) for a named GPU, i.e. saved tokens/s ÷ that GPU's
    prefill throughput at this context (tokens/s = peak·MFU / (F(s_c)/s_c)); or saved tokens/s ÷ the
    measured prefill tokens/s of the local device (`--measure-local`, the node's calibrated model).
  - Share of prefill compute saved = F_saved / F_all (all prompt tokens); the verdict is read from it:
    ≥ 20 % "pays", 5–20 % "marginal", < 5 % "does not pay". A window of live counters with no request
    or no prompt token has no share to read: no verdict, it says so (`no_traffic`).

Sources: Mooncake (Qin et al., FAST'25, arXiv 2407.00079) — reuse of cached KV cuts prefill compute and
TTFT; their traces have ~50 % reusable tokens; SGLang (Zheng et al., arXiv 2312.07104) — RadixAttention
prefix reuse. GPU peaks are dense (no sparsity) BF16 tensor FLOP/s from the vendors' datasheets: NVIDIA
H100 SXM 989 TFLOP/s (H100 datasheet), H200 SXM 989 TFLOP/s (H200 datasheet), A100 SXM 312 TFLOP/s (A100
datasheet), L40S 362 TFLOP/s (L40S datasheet); AMD MI300X 1307 TFLOP/s (MI300X datasheet). MFU 0.5 is an
assumption (prefill is compute-bound; large-batch prefill with FlashAttention commonly runs at 40–60 %
MFU) — override it with `--mfu`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.errors import InvalidArgument


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """What prefill FLOP depend on: parameters Ψ (weights touched per token), layers, attention width."""

    name: str
    params: float
    num_layers: int
    d_attn: int

    def prefill_flop(self, num_tokens: float) -> float:
        """F(s): FLOP to prefill `num_tokens` tokens from scratch (dense + causal attention)."""
        s = float(num_tokens)
        return 2.0 * self.params * s + 4.0 * self.num_layers * self.d_attn * s * (s + 1.0) / 2.0


MODELS = {
    "llama-3-8b": ModelShape(name="llama-3-8b", params=8.0e9, num_layers=32, d_attn=4096),
    "llama-3-70b": ModelShape(name="llama-3-70b", params=70.6e9, num_layers=80, d_attn=8192),
    "qwen2.5-7b": ModelShape(name="qwen2.5-7b", params=7.6e9, num_layers=28, d_attn=3584),
}
"""Shapes from the models' published configs (hidden size = n_heads·head_dim = d_attn)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    name: str
    peak_flop_per_s: float
    source: str


GPUS = {
    "H100-SXM": Gpu(name="H100-SXM", peak_flop_per_s=989e12, source="NVIDIA H100 datasheet, dense BF16"),
    "H200-SXM": Gpu(name="H200-SXM", peak_flop_per_s=989e12, source="NVIDIA H200 datasheet, dense BF16"),
    "A100-SXM": Gpu(name="A100-SXM", peak_flop_per_s=312e12, source="NVIDIA A100 datasheet, dense BF16"),
    "L40S": Gpu(name="L40S", peak_flop_per_s=362e12, source="NVIDIA L40S datasheet, dense BF16"),
    "MI300X": Gpu(name="MI300X", peak_flop_per_s=1307e12, source="AMD MI300X datasheet, dense BF16"),
}
DEFAULT_MFU = 0.5
HIT_RATES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9)


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """λ (requests/s), h (share of requests reusing anything), s_c (mean reused tokens of those),
    s_prompt (mean prompt tokens of all requests)."""

    request_rate_per_s: float
    hit_request_share: float
    mean_reused_tokens: float
    mean_prompt_tokens: float

    def __post_init__(self) -> None:
        if self.request_rate_per_s < 0 or self.mean_reused_tokens < 0 or self.mean_prompt_tokens < 0:
            raise InvalidArgument("rates and token counts must be >= 0")
        if not 0.0 <= self.hit_request_share <= 1.0:
            raise InvalidArgument(f"h must be in [0, 1], got {self.hit_request_share}")

    @property
    def saved_tokens_per_s(self) -> float:
        """S = λ·h·s_c."""
        return self.request_rate_per_s * self.hit_request_share * self.mean_reused_tokens

    @property
    def token_hit_rate(self) -> float:
        """Reused / prompt tokens = h·s_c / s_prompt."""
        if self.mean_prompt_tokens <= 0:
            return 0.0
        return self.hit_request_share * self.mean_reused_tokens / self.mean_prompt_tokens


def saved_flop_per_s(w: Workload, model: ModelShape) -> float:
    """λ·h·F(s_c) (from the means; see the module docstring)."""
    return w.request_rate_per_s * w.hit_request_share * model.prefill_flop(w.mean_reused_tokens)


def gpu_prefill_tokens_per_s(
    gpu: Gpu, model: ModelShape, context_tokens: float, mfu: float = DEFAULT_MFU
) -> float:
    """One GPU's prefill throughput for prompts of `context_tokens`: peak·MFU / (F(s)/s)."""
    if context_tokens <= 0:
        return gpu.peak_flop_per_s * mfu / (2.0 * model.params)
    return gpu.peak_flop_per_s * mfu * context_tokens / model.prefill_flop(context_tokens)


def gpus_saved(flop_per_s: float, gpu: Gpu, mfu: float = DEFAULT_MFU) -> float:
    """FLOP/s saved ÷ (peak·MFU)."""
    if not 0.0 < mfu <= 1.0:
        raise InvalidArgument(f"mfu must be in (0, 1], got {mfu}")
    return flop_per_s / (gpu.peak_flop_per_s * mfu)


def has_traffic(w: Workload) -> bool:
    """Whether any request with prompt tokens came in: without one there is no share to judge."""
    return w.request_rate_per_s > 0 and w.mean_prompt_tokens > 0


def no_traffic(window_s: float) -> str:
    """The line that stands for the verdict over a window without traffic."""
    return f"no traffic in the {window_s:g} s window: no prefill request reached the master, so no verdict"


PAYS_SHARE = 0.20
"""The share of prefill compute saved from which the pool "pays" (the module docstring's thresholds)."""


def verdict(share_saved: float, gpus: float, gpu_name: str) -> str:
    """One line from the share of prefill compute saved (thresholds in the module docstring)."""
    word = "pays" if share_saved >= PAYS_SHARE else "marginal" if share_saved >= 0.05 else "does not pay"
    return f"{word}: the pool saves {share_saved:.0%} of prefill compute ≈ {gpus:.2f} {gpu_name} at MFU-adjusted peak"


def economics_table(
    w: Workload,
    model: ModelShape,
    *,
    gpu_names: Sequence[str] = ("H100-SXM", "A100-SXM"),
    mfu: float = DEFAULT_MFU,
    hit_rates: Sequence[float] = HIT_RATES,
    local_tokens_per_s: float | None = None,
) -> list[dict[str, Any]]:
    """One row per h in `hit_rates` (λ, s_c, s_prompt fixed from `w`) plus the measured one (`measured`)."""
    rows = []
    for h, measured in [(h, False) for h in hit_rates] + [(w.hit_request_share, True)]:
        wh = Workload(
            request_rate_per_s=w.request_rate_per_s,
            hit_request_share=h,
            mean_reused_tokens=w.mean_reused_tokens,
            mean_prompt_tokens=w.mean_prompt_tokens,
        )
        flop = saved_flop_per_s(wh, model)
        total = w.request_rate_per_s * model.prefill_flop(w.mean_prompt_tokens)
        row: dict[str, Any] = {
            "measured": measured,
            "h": h,
            "token_hit_rate": wh.token_hit_rate,
            "saved_tokens_per_s": wh.saved_tokens_per_s,
            "saved_flop_per_s": flop,
            "share_prefill_flop_saved": flop / total if total else 0.0,
        }
        for g in gpu_names:
            row[f"gpus_saved_{g}"] = gpus_saved(flop, GPUS[g], mfu)
        if local_tokens_per_s:
            row["local_devices_saved"] = wh.saved_tokens_per_s / local_tokens_per_s
        rows.append(row)
    return rows


# ---------------------------------------------------------------- inputs: a trace replay, live counters


def workload_from_trace(
    path: Path, *, capacity_frac: float | None = None, policy: str = "default"
) -> tuple[Workload, dict[str, Any]]:
    """Replay a Mooncake-format trace through the real `RadixIndex` (no eviction unless `capacity_frac`):
    per request, reused tokens = the leading resident blocks' tokens (capped at its input length)."""
    # the trace benchmark's block semantics and insertion (shared on purpose)
    from kvpool.index import RadixIndex, make_policy
    from kvpool.trace import TRACE_BLOCK_TOKENS, TRACE_NS, block_hash, insert_rest, load_trace
    from kvpool.types import FakeClock

    trace = load_trace(path)
    capacity = None if capacity_frac is None else max(1, int(capacity_frac * trace.num_unique_blocks))
    clock = FakeClock(0)
    index = RadixIndex(clock=clock, policy=make_policy(policy))
    index.register_namespace(TRACE_NS)
    reused: list[int] = []
    prompts: list[int] = []
    now_ms = -1
    for req in trace.requests:
        now_ms = max(req.timestamp_ms, now_ms + 1)
        clock.set(now_ms)
        hashes = [block_hash(b) for b in req.hash_ids]
        matched = index.match_prefix(TRACE_NS, hashes, count_hit=True, lease_ttl_ms=0).num_matched
        reused.append(min(matched * TRACE_BLOCK_TOKENS, req.input_length))
        prompts.append(req.input_length)
        if matched < len(hashes):
            insert_rest(index, hashes, matched, req.input_length)
        if capacity is not None and index.num_blocks > capacity:
            index.evict(index.num_blocks - capacity)
    duration_s = max(1e-3, (trace.requests[-1].timestamp_ms - trace.requests[0].timestamp_ms) / 1e3)
    hits = [r for r in reused if r > 0]
    w = Workload(
        request_rate_per_s=len(reused) / duration_s,
        hit_request_share=len(hits) / len(reused),
        mean_reused_tokens=sum(hits) / len(hits) if hits else 0.0,
        mean_prompt_tokens=sum(prompts) / len(prompts),
    )
    info = {
        "source": f"trace {path.name}",
        "num_requests": len(reused),
        "duration_s": duration_s,
        "capacity_blocks": capacity,
        "policy": policy,
        "reused_tokens": reused,
        "prompt_tokens": prompts,
    }
    return w, info


def exact_saved_flop_per_s(reused: Sequence[int], duration_s: float, model: ModelShape) -> float:
    """Σ_i F(s_i) / duration over the requests' own reused tokens (no averaging)."""
    return sum(model.prefill_flop(s) for s in reused if s > 0) / duration_s


def workload_from_counters(before: Any, after: Any, window_s: float) -> Workload:
    """From two `MasterClient.stats()` snapshots: λ = Δmatches/Δt, S = Δhit_tokens/Δt. The counters do not
    split h from s_c, so h is reported as 1 when anything hit (s_c = S/λ is then the mean per request)."""
    n = after.num_match_requests - before.num_match_requests
    hit = after.hit_tokens - before.hit_tokens
    req = after.requested_tokens - before.requested_tokens
    if window_s <= 0:
        raise InvalidArgument("window must be > 0")
    return Workload(
        request_rate_per_s=n / window_s,
        hit_request_share=1.0 if hit > 0 else 0.0,
        mean_reused_tokens=hit / n if n else 0.0,
        mean_prompt_tokens=req / n if n else 0.0,
    )
