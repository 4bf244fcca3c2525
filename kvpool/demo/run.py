"""`kvpool demo`: start a local cluster (master, 2 stores, 1 prefill, 1 decode), serve RAG and chat
requests through it, check every cached answer against a cold recompute, print a report, stop.

The cold reference of each request runs through the same processes with the cache disabled
(`use_cache=False`, nothing published), so the equality check covers the whole pull/scatter path.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool.demo.orchestrator import Orchestrator, RequestResult
from kvpool.demo.workload import DemoRequest, chat_requests, default_chat_trace, rag_requests
from kvpool.report import write_report
from kvpool.sampling import SamplingParams
from kvpool.trace import Trace

log = logging.getLogger(__name__)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(pairs: list[tuple[DemoRequest, RequestResult, RequestResult]]) -> dict[str, Any]:
    """Report figures over (request, warm result, cold reference) triples."""
    warm = [w for _, w, _ in pairs]
    cold_ttft = [c.ttft_s for _, _, c in pairs]
    hit_ttft = [w.ttft_s for w in warm if w.prefill.get("num_reused_tokens", 0) > 0]
    prompt = sum(w.num_prompt_tokens for w in warm)
    reused = sum(w.prefill.get("num_reused_tokens", 0) for w in warm)
    decisions: dict[str, int] = {}
    for w in warm:
        for key in (f"prefill:{w.prefill.get('decision')}", f"decode:{w.decode.get('decision')}"):
            decisions[key] = decisions.get(key, 0) + 1
    ttft_cold_p50 = statistics.median(cold_ttft) if cold_ttft else 0.0
    ttft_warm_p50 = statistics.median(hit_ttft) if hit_ttft else 0.0
    return {
        "requests": len(pairs),
        "requests_with_hits": len(hit_ttft),
        "ttft_cold_p50_s": ttft_cold_p50,
        "ttft_cold_p90_s": _pct(cold_ttft, 0.9),
        "ttft_warm_p50_s": ttft_warm_p50,
        "ttft_warm_p90_s": _pct(hit_ttft, 0.9),
        "speedup": ttft_cold_p50 / ttft_warm_p50 if ttft_warm_p50 else 0.0,
        "token_hit_rate": reused / prompt if prompt else 0.0,
        "prefill_pulled_bytes": sum(w.prefill.get("pulled_bytes", 0) for w in warm),
        "decode_pulled_bytes": sum(w.decode.get("pulled_bytes", 0) for w in warm),
        "decisions": decisions,
        "greedy_equal": all(w.tokens == c.tokens for _, w, c in pairs),
        "num_unequal": sum(w.tokens != c.tokens for _, w, c in pairs),
    }


def run_demo(
    *,
    json_out: Path | None = None,
    trace: Path | Trace | None = None,
    trace_block_tokens: int = 64,
    num_conversations: int = 4,
    questions_per_doc: int = 3,
    max_tokens: int = 8,
    block_size: int = 64,
    device: str = "cpu",
    model_dir: str | None = None,
) -> dict[str, Any]:
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec
    from kvpool.model import ModelRunner

    console = Console()
    t_start = time.perf_counter()
    console.print(f"loading the model {model_dir or '(the embedded one, created on first use)'} ...")
    runner = ModelRunner.load(model_dir, device="cpu", block_size=block_size)
    if runner.synthetic:
        console.print(
            f"[yellow]model {runner.model_id}: SYNTHETIC weights (random, fixed seed) - its text is gibberish; "
            "the KV, the reuse and the equality checks are real.[/yellow]"
        )
    rag = rag_requests(runner.encode, questions_per_doc=questions_per_doc)
    chat = chat_requests(
        trace or default_chat_trace(),
        vocab_size=min(runner.vocab_size, 256),
        num_conversations=num_conversations,
        trace_block_tokens=trace_block_tokens,
    )
    spec = LocalClusterSpec(
        layout=runner.layout.fingerprint(), block_size=block_size, device=device, model_dir=model_dir
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    results: dict[str, list[tuple[DemoRequest, RequestResult, RequestResult]]] = {"rag": [], "chat": []}
    console.print(f"starting a local cluster: master, {spec.num_stores} store nodes, 1 prefill, 1 decode ...")
    with LocalCluster(spec) as cluster:
        console.print(
            f"cluster up in {time.perf_counter() - t_start:.1f} s (master {cluster.master_address})"
        )
        orch = Orchestrator(cluster.prefill_addresses[0], cluster.decode_addresses[0])
        try:
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("serving requests", total=len(rag) + len(chat))
                for req in rag + chat:
                    warm = orch.run(req.token_ids, sampling=sampling, request_id=req.request_id)
                    cold = orch.run(
                        req.token_ids,
                        sampling=sampling,
                        use_cache=False,
                        publish=False,
                        request_id=req.request_id + "-cold",
                    )
                    results[req.scenario].append((req, warm, cold))
                    progress.advance(task)
        finally:
            orch.close()
    summaries = {name: summarize(pairs) for name, pairs in results.items() if pairs}
    everything = [p for pairs in results.values() for p in pairs]
    overall = summarize(everything)
    overall["wall_s"] = time.perf_counter() - t_start
    _print_report(console, summaries, overall)
    records = [
        {
            "scenario": req.scenario,
            "request_id": req.request_id,
            "label": req.label,
            "prompt_tokens": w.num_prompt_tokens,
            "reused_tokens": w.prefill.get("num_reused_tokens", 0),
            "ttft_warm_s": w.ttft_s,
            "ttft_cold_s": c.ttft_s,
            "prefill_decision": w.prefill.get("decision"),
            "decode_decision": w.decode.get("decision"),
            "publish": w.publish_status,
            "greedy_equal": w.tokens == c.tokens,
        }
        for req, w, c in everything
    ]
    summary = {
        **{
            k: overall[k]
            for k in (
                "ttft_cold_p50_s",
                "ttft_warm_p50_s",
                "speedup",
                "token_hit_rate",
                "greedy_equal",
                "requests",
                "wall_s",
            )
        },
        "scenarios": summaries,
    }
    write_report(json_out, "demo", records, summary)
    return summary


COMMON_ROWS: list[tuple[str, Any]] = [
    ("requests (with hits)", lambda s: f"{s['requests']} ({s['requests_with_hits']})"),
    ("TTFT cold p50 / p90 s", lambda s: f"{s['ttft_cold_p50_s']:.3f} / {s['ttft_cold_p90_s']:.3f}"),
    ("TTFT warm p50 / p90 s", lambda s: f"{s['ttft_warm_p50_s']:.3f} / {s['ttft_warm_p90_s']:.3f}"),
    ("TTFT speedup (p50)", lambda s: f"{s['speedup']:.1f}x"),
]
"""The demo tables' first rows: (label, format of one summary)."""
EQUAL_ROW: tuple[str, Any] = (
    "greedy equal to cold",
    lambda s: "yes" if s["greedy_equal"] else f"NO ({s['num_unequal']} differ)",
)


def scenario_table(
    title: str, summaries: dict[str, dict[str, Any]], overall: dict[str, Any], rows: list[tuple[str, Any]]
) -> Table:
    """One column per scenario and one for all, one row per (label, format) (fits an 80-column terminal)."""
    table = Table(title=title)
    columns = [*summaries.items(), ("all", overall)]
    table.add_column("")
    for name, _ in columns:
        table.add_column(name, justify="right")
    for label, fmt in rows:
        table.add_row(label, *(fmt(s) for _, s in columns))
    return table


def _print_report(console: Console, summaries: dict[str, dict[str, Any]], overall: dict[str, Any]) -> None:
    rows: list[tuple[str, Any]] = [
        *COMMON_ROWS,
        ("token hit rate", lambda s: f"{s['token_hit_rate']:.1%}"),
        ("pulled by prefill MiB", lambda s: f"{s['prefill_pulled_bytes'] / 2**20:.1f}"),
        ("pulled by decode MiB", lambda s: f"{s['decode_pulled_bytes'] / 2**20:.1f}"),
        EQUAL_ROW,
    ]
    for key in sorted(overall["decisions"]):
        rows.append((f"decisions {key}", lambda s, key=key: str(s["decisions"].get(key, 0))))
    console.print(
        scenario_table(
            "kvpool demo: cached (warm) vs cold recompute, same processes", summaries, overall, rows
        )
    )
    console.print(f"wall time {overall['wall_s']:.1f} s")
