"""Hit-rate economics: prefill tokens, FLOP and GPUs a KV pool saves (`kvpool bench economics`, `kvpool
admin economics`).

Definitions (DESIGN.md, "Why"):
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
from dataclasses import asdict, dataclass
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


def verdict(share_saved: float, gpus: float, gpu_name: str) -> str:
    """One line from the share of prefill compute saved (thresholds in the module docstring)."""
    word = "pays" if share_saved >= 0.20 else "marginal" if share_saved >= 0.05 else "does not pay"
    return f"{word}: the pool saves {share_saved:.0%} of prefill compute ≈ {gpus:.2f} {gpu_name} at MFU-adjusted peak"


def economics_table(
    w: Workload, model: ModelShape, *, gpu_names: Sequence[str] = ("H100-SXM", "A100-SXM"), mfu: float = DEFAULT_MFU,
    hit_rates: Sequence[float] = HIT_RATES, local_tokens_per_s: float | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per h in `hit_rates` (λ, s_c, s_prompt fixed from `w`) plus the measured one (`measured`)."""
    rows = []
    for h, measured in [(h, False) for h in hit_rates] + [(w.hit_request_share, True)]:
        wh = Workload(request_rate_per_s=w.request_rate_per_s, hit_request_share=h,
                      mean_reused_tokens=w.mean_reused_tokens, mean_prompt_tokens=w.mean_prompt_tokens)  # fmt: skip
        flop = saved_flop_per_s(wh, model)
        total = w.request_rate_per_s * model.prefill_flop(w.mean_prompt_tokens)
        row: dict[str, Any] = {
            "measured": measured, "h": h, "token_hit_rate": wh.token_hit_rate,
            "saved_tokens_per_s": wh.saved_tokens_per_s, "saved_flop_per_s": flop,
            "share_prefill_flop_saved": flop / total if total else 0.0,
        }  # fmt: skip
        for g in gpu_names:
            row[f"gpus_saved_{g}"] = gpus_saved(flop, GPUS[g], mfu)
        if local_tokens_per_s:
            row["local_devices_saved"] = wh.saved_tokens_per_s / local_tokens_per_s
        rows.append(row)
    return rows


# ---------------------------------------------------------------- inputs: a trace replay, live counters


def workload_from_trace(path: Path, *, capacity_frac: float | None = None, policy: str = "default") -> tuple[Workload, dict[str, Any]]:  # fmt: skip
    """Replay a Mooncake-format trace through the real `RadixIndex` (no eviction unless `capacity_frac`):
    per request, reused tokens = the leading resident blocks' tokens (capped at its input length)."""
    # the trace benchmark's block semantics and insertion (shared on purpose)
    from kvpool.bench.trace import _NS, TRACE_BLOCK_TOKENS, _block_hash, _insert_rest, load_trace
    from kvpool.index import RadixIndex, make_policy
    from kvpool.types import FakeClock

    trace = load_trace(path)
    capacity = None if capacity_frac is None else max(1, int(capacity_frac * trace.num_unique_blocks))
    clock = FakeClock(0)
    index = RadixIndex(clock=clock, policy=make_policy(policy))
    index.register_namespace(_NS)
    reused: list[int] = []
    prompts: list[int] = []
    now_ms = -1
    for req in trace.requests:
        now_ms = max(req.timestamp_ms, now_ms + 1)
        clock.set(now_ms)
        hashes = [_block_hash(b) for b in req.hash_ids]
        matched = index.match_prefix(_NS, hashes, count_hit=True, lease_ttl_ms=0).num_matched
        reused.append(min(matched * TRACE_BLOCK_TOKENS, req.input_length))
        prompts.append(req.input_length)
        if matched < len(hashes):
            _insert_rest(index, hashes, matched, req.input_length)
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
    info = {"source": f"trace {path.name}", "num_requests": len(reused), "duration_s": duration_s,
            "capacity_blocks": capacity, "policy": policy, "reused_tokens": reused, "prompt_tokens": prompts}  # fmt: skip
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


def local_prefill_tokens_per_s(context_tokens: int) -> tuple[float, str]:
    """The local device's measured prefill tokens/s of the embedded model at `context_tokens` (calibrated)."""
    from kvpool.model import ModelRunner, calibrate_recompute, embedded_model_dir

    runner = ModelRunner.load(str(embedded_model_dir()), device="cpu")
    model = calibrate_recompute(runner)
    n = max(1, int(context_tokens))
    return model.tokens_per_s(n), f"{runner.model_id} on cpu (calibrated), {n}-token prompts"


# ---------------------------------------------------------------- the benchmark


def run_economics(
    *,
    trace: Path | None = None,
    master: str | None = None,
    window_s: float = 5.0,
    model_name: str = "llama-3-8b",
    gpu_names: Sequence[str] = ("H100-SXM", "A100-SXM"),
    mfu: float = DEFAULT_MFU,
    capacity_frac: float | None = None,
    measure_local: bool = False,
    json_out: Path | None = None,
) -> dict[str, Any]:
    """Economics from a trace replay (default: the bundled conversation trace) or live master counters."""
    import time

    from rich.console import Console
    from rich.table import Table

    from kvpool.bench.report import write_report

    if model_name not in MODELS:
        raise InvalidArgument(f"unknown model {model_name!r}; known: {', '.join(MODELS)}")
    for g in gpu_names:
        if g not in GPUS:
            raise InvalidArgument(f"unknown GPU {g!r}; known: {', '.join(GPUS)}")
    model = MODELS[model_name]
    console = Console()
    exact: float | None = None
    exact_total = 0.0
    if master:
        from kvpool.client import MasterClient

        with MasterClient(master) as client:
            a = client.stats()
            time.sleep(window_s)
            b = client.stats()
        w = workload_from_counters(a, b, window_s)
        info: dict[str, Any] = {"source": f"live counters of {master} over {window_s} s"}
    else:
        path = (
            trace or Path(__file__).resolve().parent.parent / "data" / "traces" / "conversation_small.jsonl"
        )
        w, info = workload_from_trace(path, capacity_frac=capacity_frac)
        exact = exact_saved_flop_per_s(info.pop("reused_tokens"), info["duration_s"], model)
        exact_total = exact_saved_flop_per_s(info.pop("prompt_tokens"), info["duration_s"], model)
    local_tps, local_desc = (
        local_prefill_tokens_per_s(int(w.mean_reused_tokens)) if measure_local else (None, "")
    )
    rows = economics_table(w, model, gpu_names=gpu_names, mfu=mfu, local_tokens_per_s=local_tps)
    measured = rows[-1]
    if exact is not None:  # a replay knows every request: the measured row uses Σ F(s_i), not F(mean)
        measured |= {"saved_flop_per_s": exact, "share_prefill_flop_saved": exact / exact_total if exact_total else 0.0,
                     **{f"gpus_saved_{g}": gpus_saved(exact, GPUS[g], mfu) for g in gpu_names}}  # fmt: skip
    line = (
        verdict(measured["share_prefill_flop_saved"], measured[f"gpus_saved_{gpu_names[0]}"], gpu_names[0])
        if has_traffic(w)
        else no_traffic(window_s)
    )
    table = Table(title=f"economics: {model.name}, λ = {w.request_rate_per_s:.2f} req/s, s_c = "
                        f"{w.mean_reused_tokens:.0f} tokens, s_prompt = {w.mean_prompt_tokens:.0f} ({info['source']})")  # fmt: skip
    for col in (
        "h",
        "token hit rate",
        "saved tok/s",
        "saved TFLOP/s",
        "share of prefill",
        *[f"{g} saved" for g in gpu_names],
    ):
        table.add_column(col, justify="right")
    if local_tps:
        table.add_column("local devices saved", justify="right")
    for r in rows:
        cells = [f"{r['h']:.2f}" + ("*" if r["measured"] else ""), f"{r['token_hit_rate']:.1%}",
                 f"{r['saved_tokens_per_s']:,.0f}", f"{r['saved_flop_per_s'] / 1e12:,.1f}",
                 f"{r['share_prefill_flop_saved']:.1%}", *[f"{r[f'gpus_saved_{g}']:.2f}" for g in gpu_names]]  # fmt: skip
        if local_tps:
            cells.append(f"{r['local_devices_saved']:.1f}")
        table.add_row(*cells)
    console.print(table)
    console.print(f"* measured: h = {w.hit_request_share:.3f} of requests reuse, s_c = {w.mean_reused_tokens:.0f} tokens each"
                  + ("; its FLOP, share and GPUs are exact (Σ F(s_i)/T), the other rows use F(s_c)" if exact else ""))  # fmt: skip
    console.print(f"verdict: {line}")
    summary = {
        "workload": asdict(w), "saved_tokens_per_s": w.saved_tokens_per_s, "token_hit_rate": w.token_hit_rate,
        "saved_flop_per_s": measured["saved_flop_per_s"], "saved_flop_per_s_exact": exact,
        "share_prefill_flop_saved": measured["share_prefill_flop_saved"],
        **{f"gpus_saved_{g}": measured[f"gpus_saved_{g}"] for g in gpu_names},
        "model": asdict(model), "mfu": mfu, "gpus": {g: asdict(GPUS[g]) for g in gpu_names},
        "local_prefill_tokens_per_s": local_tps, "local_device": local_desc, "verdict": line, **info,
    }  # fmt: skip
    return write_report(json_out, "economics", rows, summary)
