"""`kvpool bench routing`: routing policies compared on the conversation trace.

Mode "sim": `kvpool.bench.routing_sim` (the real router, index and load decision in a discrete-event
simulation whose service times are **measured** TTFTs, `kvpool.bench.routing_service`, not the cost model
the `cost` policy scores with) for every node count x policy. Mode "real": a small live cluster (1 store,
2 prefill, 1 decode, the embedded model on this machine's CPUs) served through the real `RouterService`
in-process; the first `num_requests` of the trace are cut into batches and the policies **interleaved per
batch** (policy A's batch 1, policy B's batch 1, ..., then batch 2; the order rotates from one batch slot
to the next) and the whole run repeated `rounds` times, so that the machine's drift and the other jobs'
load fall on every policy alike. Each policy-round has its own namespace (each round starts cold; within
a round a policy's batches see the blocks its earlier batches published). Next to it the simulation of
that very workload ("sim" records with `workload` "real-mirror") as the sanity check. TTFT = first token
− scheduled arrival. Records: `{"mode", "policy", "num_nodes", "p50_ttft_s", "p90_ttft_s",
"token_hit_rate", "imbalance", ...}`, imbalance = max / mean computed (prefilled) tokens per node; a live
record adds `num_failed` and per-round p50/p90 with their spread. Target (at 8 nodes, simulated):
`cost`'s p90 TTFT at least 10 % below both `affinity`'s and `least-load`'s; `target_met` is False when a
figure is missing or a live request failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.bench.routing_service import ServiceTimes, table_profile
from kvpool.bench.routing_sim import SimConfig, simulate
from kvpool.bench.routing_workload import EMBEDDED_CPU, PROFILES, SimProfile, build_workload
from kvpool.errors import InvalidArgument
from kvpool.report import write_report
from kvpool.router.policy import POLICIES
from kvpool.trace import BUNDLED_TRACE, Trace, full_trace, load_trace

TARGET_NODES = 8
TARGET_GAIN = 0.10


def default_trace(quick: bool) -> Path:
    """The full Mooncake conversation trace `KVPOOL_TRACE` names (not with `quick`), else the bundled 400
    requests."""
    return BUNDLED_TRACE if quick else full_trace()


def run_sim_grid(
    trace: Trace,
    nodes: Sequence[int],
    policies: Sequence[str],
    profile: SimProfile,
    service: ServiceTimes,
    *,
    load: float,
    seed: int,
    max_requests: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One "sim" record per node count x policy (same workload for every policy of a node count); one trace
    hash id is one block of the table's `block_tokens`, the load scaled by the table's cold TTFTs."""
    from tqdm import tqdm

    records = []
    with tqdm(total=len(nodes) * len(policies), unit="run", disable=not progress, desc="routing sim") as bar:
        for n in nodes:
            wl = build_workload(
                trace,
                profile,
                num_nodes=n,
                load=load,
                block_tokens=service.block_tokens,
                max_requests=max_requests,
                cold_s=service.cold_s,
            )
            for policy in policies:
                cfg = SimConfig(policy=policy, num_nodes=n, profile=profile, service=service, seed=seed)
                rec = simulate(wl, cfg).record()
                rec.update(
                    workload=trace.name, profile=profile.name, load=load, time_scale=round(wl.time_scale, 4)
                )
                records.append(rec)
                bar.update()
    return records


def _gains(p90: dict[str, Any]) -> dict[str, float | None]:
    out = {}
    for other, key in (("affinity", "vs_affinity"), ("least-load", "vs_least_load")):
        c, o = p90.get("cost"), p90.get(other)
        out[key] = round(1.0 - c / o, 4) if c is not None and o else None
    return out


def summarize(records: Sequence[dict[str, Any]], nodes: Sequence[int]) -> dict[str, Any]:
    """p90 per node count and policy; cost's p90 gain vs affinity and least-load at 8 nodes; the target
    (`target_met`, a boolean: both gains >= `TARGET_GAIN`, False when one is missing or a live request
    failed). Live: p50/p90 per policy with their spread over the rounds, the failures, cost's gains at 2
    nodes and real/sim p90 (None for a policy with failures)."""
    sim = [r for r in records if r["mode"] == "sim" and r.get("workload") != "real-mirror"]
    p90 = {str(n): {r["policy"]: r["p90_ttft_s"] for r in sim if r["num_nodes"] == n} for n in nodes}
    out: dict[str, Any] = {"p90_ttft_s": p90, "target_nodes": TARGET_NODES, "target_gain": TARGET_GAIN}
    g = _gains(p90.get(str(TARGET_NODES), {}))
    out["cost_p90_gain_vs_affinity"], out["cost_p90_gain_vs_least_load"] = (
        g["vs_affinity"],
        g["vs_least_load"],
    )
    sim_met = all(x is not None and x >= TARGET_GAIN for x in g.values())
    real = {r["policy"]: r for r in records if r["mode"] == "real"}
    mirror = {r["policy"]: r for r in records if r["mode"] == "sim" and r.get("workload") == "real-mirror"}
    failed = sum(r.get("num_failed", 0) for r in real.values())
    if real:
        ok = {p: r for p, r in real.items() if not r.get("num_failed")}
        out["real_failed_requests"] = failed
        out["real_ttft_s"] = {
            p: {
                k: r.get(k)
                for k in (
                    "p50_ttft_s",
                    "p90_ttft_s",
                    "p50_ttft_s_by_round",
                    "p90_ttft_s_by_round",
                    "p90_spread_s",
                )
            }
            | {"num_failed": r.get("num_failed", 0)}
            for p, r in real.items()
        }
        rg = _gains({p: r["p90_ttft_s"] for p, r in ok.items()})
        out["real_cost_p90_gain_vs_affinity"], out["real_cost_p90_gain_vs_least_load"] = (
            rg["vs_affinity"],
            rg["vs_least_load"],
        )
        out["real_over_sim_p90"] = {
            p: (
                round(real[p]["p90_ttft_s"] / mirror[p]["p90_ttft_s"], 3)
                if p in ok and p in mirror and mirror[p]["p90_ttft_s"]
                else None
            )
            for p in real
        }
    out["target_met"] = bool(sim_met and failed == 0)
    return out


def load_service_times(path: Path | None, profile: str) -> ServiceTimes:
    """The measured table (`path`, default the shipped one, recorded with the embedded model on this
    CPU); `InvalidArgument` for another profile without a table of its own."""
    if path is None and profile != EMBEDDED_CPU.name:
        raise InvalidArgument(
            f"profile {profile!r} has no measured service times (the shipped table was recorded with the "
            "embedded model on a CPU): record one on that hardware with `kvpool bench ttft --routing-table "
            "OUT` and pass --service-times OUT"
        )
    return ServiceTimes.load(path)


def run_routing(
    *,
    trace_path: Path | None = None,
    nodes: Sequence[int] = (4, 8, 16),
    policies: Sequence[str] = POLICIES,
    profile: str = "embedded-cpu",
    service_times: Path | None = None,
    load: float = 0.9,
    seed: int = 0,
    quick: bool = False,
    real: bool = True,
    real_requests: int = 40,
    real_batch: int = 10,
    real_rounds: int = 3,
    max_requests: int | None = None,
    json_out: Path | None = None,
    plot_out: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the grid (and the live run), print the table, write the report (and plot)."""
    from kvpool.bench.routing_live import run_real
    from kvpool.bench.routing_report import plot_routing, print_routing

    if profile not in PROFILES:
        raise InvalidArgument(f"unknown profile {profile!r}; expected one of {', '.join(PROFILES)}")
    for p in policies:
        if p not in POLICIES:
            raise InvalidArgument(f"unknown policy {p!r}; expected one of {', '.join(POLICIES)}")
    if not nodes or min(nodes) < 1 or not load > 0:
        raise InvalidArgument("--nodes must be positive integers and --load > 0")
    if real and (real_rounds < 1 or real_batch < 1 or real_requests < 1):
        raise InvalidArgument("--real-requests, --real-batch and --real-rounds must be >= 1")
    service = load_service_times(service_times, profile)
    sim_profile = table_profile(PROFILES[profile], service)
    trace = load_trace(trace_path or default_trace(quick))
    records = run_sim_grid(
        trace,
        nodes,
        policies,
        sim_profile,
        service,
        load=load,
        seed=seed,
        max_requests=max_requests,
        progress=progress,
    )
    info: dict[str, Any] = {}
    if real:
        real_recs, mirror, info = run_real(
            trace,
            policies,
            service,
            num_requests=real_requests,
            batch_requests=real_batch,
            rounds=real_rounds,
            load=load,
            seed=seed,
        )
        records += real_recs + mirror
    meta = service.meta
    summary = (
        summarize(records, nodes)
        | {"real_" + k: v for k, v in info.items()}
        | {
            "trace": trace.name,
            "profile": profile,
            "load": load,
            "seed": seed,
            "profile_source": sim_profile.source,
            "service_times": {
                "path": "(shipped) kvpool/data/routing_service_times.json"
                if service_times is None
                else str(service_times),
                "noise_sigma": round(service.noise_sigma, 4),
                "block_tokens": service.block_tokens,
            }
            | {k: meta.get(k) for k in ("recorded_utc", "command", "git_commit", "machine")},
        }
    )
    print_routing(records, summary, trace.name, profile, load)
    if plot_out is not None:
        plot_routing(records, plot_out)
    return write_report(json_out, "routing", records, summary)
