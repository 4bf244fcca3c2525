"""`kvpool bench routing` (issue #11): routing policies compared on the conversation trace.

Mode "sim": `kvpool.bench.routing_sim` (the real router, index and cost model in a discrete-event
simulation) for every node count x policy. Mode "real": a small live cluster (1 store, 2 prefill, 1 decode,
the embedded model on this machine's CPUs) served through the real `RouterService` in-process, the first
`num_requests` of the trace replayed open-loop per policy (each policy in its own namespace, so each starts
cold); next to it the simulation of that very workload ("sim" records with `workload` "real-mirror",
using the calibration the prefill nodes report) as the sanity check. TTFT = first token − scheduled
arrival. Records: `{"mode", "policy", "num_nodes", "p50_ttft_s", "p90_ttft_s", "token_hit_rate",
"imbalance", ...}`, imbalance = max / mean computed (prefilled) tokens per node. Target (at 8 nodes):
`cost`'s p90 TTFT at least 10 % below both `affinity`'s and `least-load`'s.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.bench.routing_sim import SimConfig, simulate, ttft_record
from kvpool.bench.routing_workload import EMBEDDED_CPU, PROFILES, SimProfile, build_workload
from kvpool.errors import InvalidArgument
from kvpool.router.policy import DEFAULT_LINK, POLICIES
from kvpool.trace import Trace, load_trace

SHARED_TRACE = Path("/work/shared/traces/conversation_trace.jsonl")
BUNDLED_TRACE = Path(__file__).resolve().parent.parent / "data" / "traces" / "conversation_small.jsonl"
TARGET_NODES = 8
TARGET_GAIN = 0.10


def default_trace(quick: bool) -> Path:
    """The full Mooncake conversation trace when present (not with `quick`), else the bundled 400 requests."""
    return SHARED_TRACE if SHARED_TRACE.is_file() and not quick else BUNDLED_TRACE


def run_sim_grid(
    trace: Trace,
    nodes: Sequence[int],
    policies: Sequence[str],
    profile: SimProfile,
    *,
    load: float,
    seed: int,
    max_requests: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One "sim" record per node count x policy (same workload for every policy of a node count)."""
    from tqdm import tqdm

    records = []
    with tqdm(total=len(nodes) * len(policies), unit="run", disable=not progress, desc="routing sim") as bar:
        for n in nodes:
            wl = build_workload(trace, profile, num_nodes=n, load=load, max_requests=max_requests)
            for policy in policies:
                rec = simulate(wl, SimConfig(policy=policy, num_nodes=n, profile=profile, seed=seed)).record()
                rec.update(
                    workload=trace.name, profile=profile.name, load=load, time_scale=round(wl.time_scale, 4)
                )
                records.append(rec)
                bar.update()
    return records


def _prompt_tokens(hash_ids: Sequence[int], prompt_len: int, block_tokens: int) -> list[int]:
    """Synthetic token ids for a trace request: `block_tokens` fixed bytes per hash id (Mooncake #1266)."""
    out: list[int] = []
    for h in hash_ids:
        out.extend(np.random.default_rng(h).integers(1, 256, block_tokens).tolist())
    return out[:prompt_len]


def _reported_recompute(master: Any, timeout_s: float) -> dict[str, float]:
    """The recompute calibration the prefill nodes report in their heartbeats (their mean; {} if none)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loads = [n.load for n in master.list_nodes() if n.node.role == "prefill" and n.alive]
        if len(loads) >= 2 and all(ld.recompute_s_per_token > 0 for ld in loads):
            return {
                "overhead_s": float(np.mean([ld.recompute_overhead_s for ld in loads])),
                "per_token_s": float(np.mean([ld.recompute_s_per_token for ld in loads])),
                "per_pair_s": float(np.mean([ld.recompute_s_per_token_ctx for ld in loads])),
            }
        time.sleep(0.5)
    return {}


def run_real(
    trace: Trace,
    policies: Sequence[str],
    *,
    num_requests: int = 40,
    block_tokens: int = 32,
    load: float = 0.9,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The live run and its simulated mirror: ("real" records, "sim" real-mirror records, info).

    Arrivals and the mirror use the documented `EMBEDDED_CPU` calibration (with the router's default
    link estimate, as the nodes report none); the live router uses whatever the nodes report, which
    `info["reported_recompute"]` records. Each trace block becomes `block_tokens` tokens (one KV block).
    """
    from kvpool.client import MasterClient
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec
    from kvpool.router.model_info import ModelInfo
    from kvpool.router.service import RouterService
    from kvpool.router.settings import RouterSettings
    from kvpool.sampling import SamplingParams

    model = ModelInfo.load(None, block_size=block_tokens)
    spec = LocalClusterSpec(
        layout=model.layout.fingerprint(),
        num_stores=1,
        num_prefill=2,
        num_decode=1,
        block_size=block_tokens,
        segment_size="256MiB",
        heartbeat_timeout_ms=30_000,
    )
    reqs = trace.requests[:num_requests]
    real, mirror = [], []
    profile = replace(
        EMBEDDED_CPU, kv_bytes_per_token=model.layout.block_nbytes // block_tokens, link=DEFAULT_LINK
    )
    quiet = logging.getLogger("kvpool.router.service")
    level = quiet.level
    with LocalCluster(spec) as cluster, MasterClient(cluster.master_address) as master:
        info: dict[str, Any] = {"reported_recompute": _reported_recompute(master, timeout_s=60.0)}
        quiet.setLevel(logging.WARNING)  # one INFO line per request otherwise
        wl = build_workload(
            trace, profile, num_nodes=2, load=load, block_tokens=block_tokens, max_requests=num_requests
        )
        prompts = [
            _prompt_tokens(r.hash_ids, s.prompt_len, block_tokens)
            for r, s in zip(reqs, wl.requests, strict=True)
        ]
        for policy in policies:
            settings = RouterSettings(
                master=cluster.master_address, policy=policy, seed=seed, block_size=block_tokens
            )
            svc = RouterService(settings, master, model).start()
            salt = f"bench-routing-{policy}-{uuid.uuid4().hex[:8]}"  # a fresh namespace: a cold start

            def one(
                i: int, t0: float, svc: RouterService = svc, salt: str = salt
            ) -> tuple[float, str, int, int]:
                ev = next(svc.generate(prompts[i], SamplingParams(max_tokens=1), cache_salt=salt))
                return time.perf_counter() - t0, ev.prefill_node, ev.prompt_tokens, ev.cached_tokens

            try:
                with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                    start = time.perf_counter() + 0.2
                    futures = []
                    for i, r in enumerate(wl.requests):
                        time.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
                        futures.append(pool.submit(one, i, start + r.arrival_s))
                    results = [f.result() for f in futures]
            finally:
                svc.close()
            names = sorted({n.node.node_id for n in master.list_nodes() if n.node.role == "prefill"})
            computed = {n: 0 for n in names}
            for _, node, n_prompt, n_cached in results:
                computed[node] = computed.get(node, 0) + n_prompt - n_cached
            rec = ttft_record(
                "real",
                policy,
                2,
                [r[0] for r in results],
                sum(r[2] for r in results),
                sum(r[3] for r in results),
                list(computed.values()),
            )
            real.append(rec | {"workload": "real-mirror", "profile": "live"})
            sim = simulate(
                wl,
                SimConfig(
                    policy=policy,
                    num_nodes=2,
                    profile=profile,
                    seed=seed,
                    pool_capacity_frac=1.0,
                    local_capacity_frac=1.0,
                ),
            ).record()
            mirror.append(sim | {"workload": "real-mirror", "profile": profile.name, "load": load})
    quiet.setLevel(level)
    return real, mirror, info


def summarize(records: Sequence[dict[str, Any]], nodes: Sequence[int]) -> dict[str, Any]:
    """p90 per node count and policy; cost's p90 gain vs affinity and least-load at 8 nodes; the target."""
    sim = [r for r in records if r["mode"] == "sim" and r.get("workload") != "real-mirror"]
    p90 = {str(n): {r["policy"]: r["p90_ttft_s"] for r in sim if r["num_nodes"] == n} for n in nodes}
    out: dict[str, Any] = {"p90_ttft_s": p90, "target_nodes": TARGET_NODES, "target_gain": TARGET_GAIN}
    at = p90.get(str(TARGET_NODES), {})
    gains = {}
    for other, key in (
        ("affinity", "cost_p90_gain_vs_affinity"),
        ("least-load", "cost_p90_gain_vs_least_load"),
    ):
        gains[key] = round(1.0 - at["cost"] / at[other], 4) if "cost" in at and at.get(other) else None
    out.update(gains)
    out["target_met"] = None if None in gains.values() else all(g >= TARGET_GAIN for g in gains.values())  # type: ignore[operator]
    real = {r["policy"]: r for r in records if r["mode"] == "real"}
    mirror = {r["policy"]: r for r in records if r["mode"] == "sim" and r.get("workload") == "real-mirror"}
    if real:
        out["real_over_sim_p90"] = {
            p: round(real[p]["p90_ttft_s"] / mirror[p]["p90_ttft_s"], 3)
            for p in real
            if mirror[p]["p90_ttft_s"]
        }
    return out


def run_routing(
    *,
    trace_path: Path | None = None,
    nodes: Sequence[int] = (4, 8, 16),
    policies: Sequence[str] = POLICIES,
    profile: str = "embedded-cpu",
    load: float = 0.9,
    seed: int = 0,
    quick: bool = False,
    real: bool = True,
    real_requests: int = 40,
    max_requests: int | None = None,
    json_out: Path | None = None,
    plot_out: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the grid (and the real run), print the table, write the report (and plot)."""
    from kvpool.console import console
    from kvpool.report import write_report

    if profile not in PROFILES:
        raise InvalidArgument(f"unknown profile {profile!r}; expected one of {', '.join(PROFILES)}")
    for p in policies:
        if p not in POLICIES:
            raise InvalidArgument(f"unknown policy {p!r}; expected one of {', '.join(POLICIES)}")
    if not nodes or min(nodes) < 1 or not load > 0:
        raise InvalidArgument("--nodes must be positive integers and --load > 0")
    trace = load_trace(trace_path or default_trace(quick))
    records = run_sim_grid(
        trace,
        nodes,
        policies,
        PROFILES[profile],
        load=load,
        seed=seed,
        max_requests=max_requests,
        progress=progress,
    )
    if real:
        real_recs, mirror, info = run_real(trace, policies, num_requests=real_requests, load=load, seed=seed)
        records += real_recs + mirror
    summary = (
        summarize(records, nodes)
        | ({"real_" + k: v for k, v in info.items()} if real else {})
        | {
            "trace": trace.name,
            "profile": profile,
            "load": load,
            "seed": seed,
            "profile_source": PROFILES[profile].source,
        }
    )
    out = console()
    out.print(_table(records, trace.name, profile, load))
    g_a, g_l = summary["cost_p90_gain_vs_affinity"], summary["cost_p90_gain_vs_least_load"]
    if g_a is not None and g_l is not None:
        out.print(
            f"{TARGET_NODES} nodes: cost p90 {g_a:+.1%} vs affinity, {g_l:+.1%} vs least-load "
            f"(target >= {TARGET_GAIN:.0%} lower: {'met' if summary['target_met'] else 'NOT met'})"
        )
    if plot_out is not None:
        _plot(records, plot_out)
    return write_report(json_out, "routing", records, summary)


def _table(records: Sequence[dict[str, Any]], trace: str, profile: str, load: float) -> Any:
    from rich.table import Table

    table = Table(title=f"routing: {trace}, {profile}, load {load} (mirror = sim of the real run)")
    for col in ("mode", "N", "policy", "p50 s", "p90 s", "p99 s", "hit", "imbal", "util"):
        table.add_column(col, justify="left" if col in ("mode", "policy") else "right")
    for r in records:
        mode = "mirror" if r["mode"] == "sim" and r.get("workload") == "real-mirror" else r["mode"]
        util = f"{r['utilization']:.2f}" if "utilization" in r else "-"
        table.add_row(
            mode,
            str(r["num_nodes"]),
            r["policy"],
            f"{r['p50_ttft_s']:.3g}",
            f"{r['p90_ttft_s']:.3g}",
            f"{r['p99_ttft_s']:.3g}",
            f"{r['token_hit_rate']:.3f}",
            f"{r['imbalance']:.2f}",
            util,
        )
    return table


def _plot(records: Sequence[dict[str, Any]], out: Path) -> None:
    """p90 TTFT per policy per node count (log scale: affinity's overload dwarfs the rest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = [r for r in records if r["mode"] == "sim" and r.get("workload") != "real-mirror"]
    nodes = sorted({r["num_nodes"] for r in sim})
    policies = list(dict.fromkeys(r["policy"] for r in sim))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, len(policies))
    for j, policy in enumerate(policies):
        ys = [
            next((r["p90_ttft_s"] for r in sim if r["num_nodes"] == n and r["policy"] == policy), 0.0)
            for n in nodes
        ]
        ax.bar([i + j * width for i in range(len(nodes))], ys, width, label=policy)
    ax.set_xticks(
        [i + width * (len(policies) - 1) / 2 for i in range(len(nodes))], [f"{n} nodes" for n in nodes]
    )
    ax.set_yscale("log")
    ax.set_ylabel("p90 TTFT (s, simulated)")
    ax.set_title("kvpool bench routing: p90 TTFT per policy")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
