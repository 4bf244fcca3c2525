"""`kvpool bench economics`: the economics model (`kvpool.economics`) over a trace replay or live master
counters, as a table and a report; `--measure-local` calibrates the embedded model on this machine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpool.economics import (
    DEFAULT_MFU,
    GPUS,
    MODELS,
    PAYS_SHARE,
    economics_table,
    exact_saved_flop_per_s,
    gpus_saved,
    has_traffic,
    no_traffic,
    verdict,
    workload_from_counters,
    workload_from_trace,
)
from kvpool.errors import InvalidArgument


def local_prefill_tokens_per_s(context_tokens: int) -> tuple[float, str]:
    """The local device's measured prefill tokens/s of the embedded model at `context_tokens` (calibrated)."""
    from kvpool.model import ModelRunner, calibrate_recompute, embedded_model_dir

    runner = ModelRunner.load(str(embedded_model_dir()), device="cpu")
    model = calibrate_recompute(runner)
    n = max(1, int(context_tokens))
    return model.tokens_per_s(n), f"{runner.model_id} on cpu (calibrated), {n}-token prompts"


# ---------------------------------------------------------------- the benchmark


def grade(share_prefill_flop_saved: float, traffic: bool) -> bool:
    """`target_met`: the workload had traffic and the pool saves at least `PAYS_SHARE` of its prefill
    compute (the verdict "pays"); "marginal", "does not pay" and no traffic are not met."""
    return traffic and share_prefill_flop_saved >= PAYS_SHARE


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

    from kvpool.report import write_report

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
        measured |= {
            "saved_flop_per_s": exact,
            "share_prefill_flop_saved": exact / exact_total if exact_total else 0.0,
            **{f"gpus_saved_{g}": gpus_saved(exact, GPUS[g], mfu) for g in gpu_names},
        }
    line = (
        verdict(measured["share_prefill_flop_saved"], measured[f"gpus_saved_{gpu_names[0]}"], gpu_names[0])
        if has_traffic(w)
        else no_traffic(window_s)
    )
    table = Table(
        title=f"economics: {model.name}, λ = {w.request_rate_per_s:.2f} req/s, s_c = "
        f"{w.mean_reused_tokens:.0f} tokens, s_prompt = {w.mean_prompt_tokens:.0f} ({info['source']})"
    )
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
        cells = [
            f"{r['h']:.2f}" + ("*" if r["measured"] else ""),
            f"{r['token_hit_rate']:.1%}",
            f"{r['saved_tokens_per_s']:,.0f}",
            f"{r['saved_flop_per_s'] / 1e12:,.1f}",
            f"{r['share_prefill_flop_saved']:.1%}",
            *[f"{r[f'gpus_saved_{g}']:.2f}" for g in gpu_names],
        ]
        if local_tps:
            cells.append(f"{r['local_devices_saved']:.1f}")
        table.add_row(*cells)
    console.print(table)
    console.print(
        f"* measured: h = {w.hit_request_share:.3f} of requests reuse, s_c = {w.mean_reused_tokens:.0f} tokens each"
        + ("; its FLOP, share and GPUs are exact (Σ F(s_i)/T), the other rows use F(s_c)" if exact else "")
    )
    met = grade(measured["share_prefill_flop_saved"], has_traffic(w))
    console.print(f"verdict: {line}")
    console.print(
        f"target (the pool pays: >= {PAYS_SHARE:.0%} of prefill compute saved): "
        + ("[green]target met[/green]" if met else "[red]target NOT met[/red]")
    )
    summary = {
        "workload": asdict(w),
        "saved_tokens_per_s": w.saved_tokens_per_s,
        "token_hit_rate": w.token_hit_rate,
        "saved_flop_per_s": measured["saved_flop_per_s"],
        "saved_flop_per_s_exact": exact,
        "share_prefill_flop_saved": measured["share_prefill_flop_saved"],
        **{f"gpus_saved_{g}": measured[f"gpus_saved_{g}"] for g in gpu_names},
        "model": asdict(model),
        "mfu": mfu,
        "gpus": {g: asdict(GPUS[g]) for g in gpu_names},
        "local_prefill_tokens_per_s": local_tps,
        "local_device": local_desc,
        "verdict": line,
        "target_share_prefill_flop_saved": PAYS_SHARE,
        "target_met": met,
        **info,
    }
    return write_report(json_out, "economics", rows, summary)
