"""`kvpool bench ttft`: cold vs warm TTFT for RAG with a long shared prefix, prefix pulled over UCX tcp.

A real cluster (master, 2 store nodes, prefill, decode) with the prefill node's local tier OFF, so a warm
request's prefix really crosses the pool's data plane; `UCX_TLS=tcp` with the stores' segments not shared
(`share_segment=false`) forces the cross-host transport.
Cold = the same prompts with the cache disabled (baseline measured in the same run). Breakdown per
request from the prefill node: match, pull, compute; publish after the first token.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpool.errors import InvalidArgument
from kvpool.report import write_report

TRANSPORTS = ("tcp", "auto")


def check_prompt_fits(prompt_tokens: int, model_dir: str | None) -> int:
    """The serving nodes' prompt limit (`kvpool.prompt.prompt_token_limit`, with their settings from
    `KVPOOL_*` as the nodes will see them); `InvalidArgument` when `prompt_tokens` exceeds it. Called
    before any process starts."""
    from kvpool.model.settings import model_context_len
    from kvpool.prompt import prompt_token_limit
    from kvpool.serving.common import ServingSettings

    max_prompt, context = ServingSettings().max_prompt_tokens, model_context_len(model_dir)
    limit = prompt_token_limit(max_prompt, context)
    if prompt_tokens > limit:
        raise InvalidArgument(
            f"a prompt of {prompt_tokens} tokens is longer than the nodes accept: the limit is {limit} tokens "
            f"(max_prompt_tokens {max_prompt}, the model's context {context} less one for the first output token)"
        )
    return limit


TARGET_WARM_OVER_COLD = 0.05


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the cold and warm requests, `warm_over_cold`, and `target_met` (bool): warm/cold <=
    `TARGET_WARM_OVER_COLD` with every warm request served from the pool (it reused the prefix). A request
    that fails raises out of the run, so every record here was served."""
    cold = [r for r in records if r["kind"] == "cold"]
    warm = [r for r in records if r["kind"] == "warm"]
    cold_s = statistics.median(r["ttft_s"] for r in cold) if cold else None
    warm_s = statistics.median(r["ttft_s"] for r in warm) if warm else None
    ratio = warm_s / cold_s if warm_s is not None and cold_s else None
    reused = sum(1 for r in warm if r["reused_tokens"] > 0)
    return {
        "ttft_cold_s": cold_s,
        "ttft_warm_s": warm_s,
        "warm_over_cold": ratio,
        "warm_reused": reused,
        "warm_match_s": statistics.median(r["match_s"] for r in warm) if warm else None,
        "warm_pull_s": statistics.median(r["pull_s"] for r in warm) if warm else None,
        "warm_compute_s": statistics.median(r["compute_s"] for r in warm) if warm else None,
        "warm_pulled_bytes": warm[0]["pulled_bytes"] if warm else 0,
        "target_warm_over_cold": TARGET_WARM_OVER_COLD,
        "target_met": ratio is not None and ratio <= TARGET_WARM_OVER_COLD and reused == len(warm),
    }


def run_ttft(
    *,
    prefix_tokens: int = 8192,
    question_tokens: int = 50,
    num_requests: int = 3,
    block_size: int = 64,
    transport: str = "tcp",
    device: str = "cpu",
    model_dir: str | None = None,
    json_out: Path | None = None,
) -> dict[str, Any]:
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec
    from kvpool.demo.orchestrator import Orchestrator
    from kvpool.model import ModelRunner
    from kvpool.sampling import SamplingParams

    if transport not in TRANSPORTS:
        raise InvalidArgument(f"transport must be {' or '.join(TRANSPORTS)}, got {transport!r}")
    check_prompt_fits(prefix_tokens + question_tokens, model_dir)
    console = Console()
    runner = ModelRunner.load(model_dir, device="cpu", block_size=block_size)
    vocab = min(runner.vocab_size, 256)
    rng = np.random.default_rng(2026)
    prefix = [int(t) for t in rng.integers(3, vocab, size=prefix_tokens)]
    questions = [
        [int(t) for t in rng.integers(3, vocab, size=question_tokens)] for _ in range(num_requests + 1)
    ]
    env = {"KVPOOL_LOCAL_TIER_BYTES": "0"}
    if transport == "tcp":  # as across hosts: UCX over tcp, and no same-host mapping of the stores' segments
        env.update(UCX_TLS="tcp", KVPOOL_SHARE_SEGMENT="false")
    seg = max(256 * 2**20, 4 * prefix_tokens * runner.layout.token_nbytes)
    spec = LocalClusterSpec(
        layout=runner.layout.fingerprint(),
        block_size=block_size,
        device=device,
        model_dir=model_dir,
        segment_size=f"{seg // 2**20}MiB",
        extra_env=env,
    )
    sampling = SamplingParams(max_tokens=1)
    records: list[dict[str, Any]] = []
    with LocalCluster(spec) as cluster:
        orch = Orchestrator(cluster.prefill_addresses[0], cluster.decode_addresses[0], timeout_s=600)
        try:
            orch.run(
                prefix + questions[0], sampling=sampling, request_id="warmup-publish"
            )  # publishes the prefix
            for i in range(1, num_requests + 1):
                prompt = prefix + questions[i]
                cold = orch.run(
                    prompt, sampling=sampling, use_cache=False, publish=False, request_id=f"cold{i}"
                )
                warm = orch.run(prompt, sampling=sampling, publish=False, request_id=f"warm{i}")
                for kind, res in (("cold", cold), ("warm", warm)):
                    p = res.prefill
                    records.append(
                        {
                            "kind": kind,
                            "prompt_tokens": len(prompt),
                            "reused_tokens": p["num_reused_tokens"],
                            "ttft_s": res.ttft_s,
                            "node_ttft_s": p["ttft_s"],
                            "match_s": p["match_s"],
                            "pull_s": p["pull_s"],
                            "compute_s": p["compute_s"],
                            "pulled_bytes": p["pulled_bytes"],
                            "decision": p["decision"],
                            "predicted_pull_s": p["predicted_pull_s"],
                            "predicted_recompute_s": p["predicted_recompute_s"],
                        }
                    )
        finally:
            orch.close()
    summary = {
        "prefix_tokens": prefix_tokens,
        "question_tokens": question_tokens,
        "transport": transport,
    } | summarize(records)
    table = Table(
        title=f"TTFT: {prefix_tokens}-token shared prefix + {question_tokens}-token question ({transport})"
    )
    for col in ("kind", "reused", "TTFT s", "match s", "pull s", "compute s", "pulled MiB", "decision"):
        table.add_column(col, justify="left" if col in ("kind", "decision") else "right")
    for r in records:
        table.add_row(
            r["kind"],
            str(r["reused_tokens"]),
            f"{r['ttft_s']:.3f}",
            f"{r['match_s']:.4f}",
            f"{r['pull_s']:.4f}",
            f"{r['compute_s']:.3f}",
            f"{r['pulled_bytes'] / 2**20:.1f}",
            r["decision"],
        )
    console.print(table)
    verdict = "[green]target met[/green]" if summary["target_met"] else "[red]target NOT met[/red]"
    ratio = "n/a" if summary["warm_over_cold"] is None else f"{summary['warm_over_cold']:.3f}"
    console.print(
        f"warm/cold = {ratio} (target <= {TARGET_WARM_OVER_COLD}, every warm request reusing the prefix: "
        f"{summary['warm_reused']} of {sum(1 for r in records if r['kind'] == 'warm')}): {verdict}"
    )
    write_report(json_out, "ttft", records, summary)
    return summary
