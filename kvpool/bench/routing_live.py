"""`kvpool bench routing`'s live mode (`kvpool.bench.routing`): a 2-prefill cluster through the real
`RouterService`, the policies interleaved per batch and the whole run repeated (see `run_real`)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from kvpool.bench.routing_service import ServiceTimes, table_profile
from kvpool.bench.routing_sim import SimConfig, simulate, ttft_record
from kvpool.bench.routing_workload import EMBEDDED_CPU, build_workload
from kvpool.errors import InvalidArgument
from kvpool.router.policy import DEFAULT_LINK
from kvpool.trace import Trace


def interleaved_schedule(
    policies: Sequence[str], num_batches: int, rounds: int
) -> list[tuple[int, int, str]]:
    """The live run's order, `(round, batch, policy)`: in every round, batch b of each policy in turn
    before batch b + 1 of any; the policies' order rotates by one from one batch slot to the next (no
    policy always runs first, right after another policy's load)."""
    if not policies or num_batches < 1 or rounds < 1:
        raise InvalidArgument("need at least one policy, one batch and one round")
    out = []
    pol = list(policies)
    for rnd in range(rounds):
        for b in range(num_batches):
            k = (rnd * num_batches + b) % len(pol)
            out += [(rnd, b, p) for p in pol[k:] + pol[:k]]
    return out


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


def live_record(policy: str, results: Sequence[dict[str, Any]], node_names: Sequence[str]) -> dict[str, Any]:
    """One policy's "real" record from its requests over every round (`results`: `round`, `ttft_s`, `node`,
    `prompt_tokens`, `cached_tokens`, `error`): percentiles of the served ones (None if none was), the
    failures counted, and p50/p90 per round with the p90's spread (max − min over the rounds)."""
    ok = [r for r in results if r["error"] is None]
    computed = {n: 0 for n in node_names}
    for r in ok:
        computed[r["node"]] = computed.get(r["node"], 0) + r["prompt_tokens"] - r["cached_tokens"]
    if ok:
        rec = ttft_record(
            "real",
            policy,
            2,
            [r["ttft_s"] for r in ok],
            sum(r["prompt_tokens"] for r in ok),
            sum(r["cached_tokens"] for r in ok),
            list(computed.values()),
        )
    else:
        rec = {"mode": "real", "policy": policy, "num_nodes": 2, "token_hit_rate": None, "imbalance": None}
        rec |= {k: None for k in ("p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "mean_ttft_s")}
    rec["num_requests"] = len(results)
    rec["num_failed"] = len(results) - len(ok)
    rec["errors"] = sorted({r["error"] for r in results if r["error"] is not None})[:5]
    by_round: dict[str, list[float | None]] = {"p50": [], "p90": []}
    for rnd in sorted({r["round"] for r in results}):
        ts = [r["ttft_s"] for r in ok if r["round"] == rnd]
        for q in (50, 90):
            by_round[f"p{q}"].append(round(float(np.percentile(ts, q)), 4) if ts else None)
    rec["p50_ttft_s_by_round"], rec["p90_ttft_s_by_round"] = by_round["p50"], by_round["p90"]
    p90s = [x for x in by_round["p90"] if x is not None]
    rec["p90_spread_s"] = round(max(p90s) - min(p90s), 4) if p90s else None
    return rec


def run_real(
    trace: Trace,
    policies: Sequence[str],
    service: ServiceTimes,
    *,
    num_requests: int = 40,
    batch_requests: int = 10,
    rounds: int = 3,
    load: float = 0.9,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The live run (interleaved, repeated: see the module docstring) and its simulated mirror:
    ("real" records, "sim" real-mirror records, info). Arrivals and the mirror use the table's measured
    service times and the calibration its node reported; the live router uses whatever the nodes report,
    which `info["reported_recompute"]` records, with the router's default link. Each trace block becomes
    the table's `block_tokens` tokens (one KV block). A request that fails is counted, not dropped."""
    from kvpool.client import MasterClient
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec
    from kvpool.router.model_info import ModelInfo
    from kvpool.router.service import RouterService
    from kvpool.router.settings import RouterSettings
    from kvpool.sampling import SamplingParams

    if batch_requests < 1 or num_requests < 1:
        raise InvalidArgument("num_requests and batch_requests must be >= 1")
    block_tokens = service.block_tokens
    model = ModelInfo.load(None, block_size=block_tokens)
    spec = LocalClusterSpec(
        layout=model.layout.fingerprint(),
        num_stores=1,
        num_prefill=2,
        num_decode=1,
        block_size=block_tokens,
        segment_size="1GiB",
        heartbeat_timeout_ms=30_000,
    )
    reqs = trace.requests[:num_requests]
    profile = replace(
        table_profile(EMBEDDED_CPU, service),
        kv_bytes_per_token=model.layout.block_nbytes // block_tokens,
        link=DEFAULT_LINK,
    )
    wl = build_workload(
        trace,
        profile,
        num_nodes=2,
        load=load,
        block_tokens=block_tokens,
        max_requests=num_requests,
        cold_s=service.cold_s,
    )
    prompts = [
        _prompt_tokens(r.hash_ids, s.prompt_len, block_tokens) for r, s in zip(reqs, wl.requests, strict=True)
    ]
    batches = [
        list(range(i, min(i + batch_requests, len(prompts)))) for i in range(0, len(prompts), batch_requests)
    ]
    schedule = interleaved_schedule(policies, len(batches), rounds)
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    quiet = logging.getLogger("kvpool.router.service")
    level = quiet.level
    t_start = time.perf_counter()
    with LocalCluster(spec) as cluster, MasterClient(cluster.master_address) as master:
        info: dict[str, Any] = {"reported_recompute": _reported_recompute(master, timeout_s=60.0)}
        quiet.setLevel(logging.WARNING)  # one INFO line per request otherwise
        svcs = {
            p: RouterService(
                RouterSettings(master=cluster.master_address, policy=p, seed=seed, block_size=block_tokens),
                master,
                model,
            ).start()
            for p in policies
        }
        run_id = uuid.uuid4().hex[:8]
        try:
            for rnd, b, policy in schedule:
                svc, salt = svcs[policy], f"bench-routing-{policy}-r{rnd}-{run_id}"  # one namespace a round

                def one(i: int, t0: float, svc: RouterService = svc, salt: str = salt) -> dict[str, Any]:
                    try:
                        ev = next(svc.generate(prompts[i], SamplingParams(max_tokens=1), cache_salt=salt))
                    except Exception as exc:  # noqa: BLE001 - a failed request is a counted failure
                        return {"error": f"{type(exc).__name__}: {exc}"[:200], "ttft_s": None}
                    return {
                        "error": None,
                        "ttft_s": time.perf_counter() - t0,
                        "node": ev.prefill_node,
                        "prompt_tokens": ev.prompt_tokens,
                        "cached_tokens": ev.cached_tokens,
                    }

                idx = batches[b]
                t_first = wl.requests[idx[0]].arrival_s
                with ThreadPoolExecutor(max_workers=len(idx)) as pool:
                    start = time.perf_counter() + 0.05
                    futures = []
                    for i in idx:
                        due = start + wl.requests[i].arrival_s - t_first
                        time.sleep(max(0.0, due - time.perf_counter()))
                        futures.append(pool.submit(one, i, due))
                    results[policy] += [f.result() | {"round": rnd, "batch": b} for f in futures]
        finally:
            for svc in svcs.values():
                svc.close()
            quiet.setLevel(level)
        names = sorted({n.node.node_id for n in master.list_nodes() if n.node.role == "prefill"})
    info |= {
        "rounds": rounds,
        "batch_requests": batch_requests,
        "order": [f"r{rnd}b{b}:{p}" for rnd, b, p in schedule],
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    real = [
        live_record(p, results[p], names) | {"workload": "real-mirror", "profile": "live"} for p in policies
    ]
    mirror = []
    for policy in policies:
        cfg = SimConfig(
            policy=policy,
            num_nodes=2,
            profile=profile,
            service=service,
            seed=seed,
            pool_capacity_frac=1.0,
            local_capacity_frac=1.0,
        )
        sim = simulate(wl, cfg).record()
        mirror.append(sim | {"workload": "real-mirror", "profile": profile.name, "load": load})
    return real, mirror, info
