"""`kvpool bench burst`: a burst of requests on one cached prefix (field case B39, pull convoys).

A real pool (master and one store node, processes of a `LocalCluster`; UCX over tcp with the store's
segment not shared, the cross-host path) and one serving node in this process: the model runner, its
calibration and a `KVConnector`, as a prefill node builds them (`NodeRuntime`), with its local tier off.
One request warms the prefix into the pool; then `burst` requests on that prefix (each with its own
question) arrive at once:

- **pull burst**: the cache on, the cost model deciding (`auto`). Each request decides and pulls in its own
  thread, so the pulls overlap each other and the forwards (as vLLM's asynchronous loads do), and each
  decision sees the pulls already in flight on the store's link (`kvpool.cost.inflight.PullLedger`);
- **recompute burst** (the baseline, same run): the same requests with the cache off.

The two arms run in `rounds` interleaved rounds (recompute then pull, then pull then recompute, ...), so a
drift in the host's load hits both; each arm's percentiles are over all its rounds' requests.

Before the measured pull burst, `warmup_bursts` unmeasured pull bursts run (default 1): a serving node
has seen traffic before, and the pulls that finished behind others taught its ledger what the store's link
drains under contention (`InFlight.bytes_per_s`), which the measured burst's decisions then use. With
`--warmup-bursts 0` the burst meets a cold node that knows only the single-stream calibration.

Forwards run one at a time (one model, `model_lock`). TTFT of a request = burst start -> its first token
(load + wait for the model + forward). Summary keys: `pull_ttft_p50_s`, `recompute_ttft_p50_s`,
`pull_over_recompute` (target <= 1), p90s, the loads' p50 and the forwards' mean per arm, the decisions,
the most pulls a decision saw in flight and the longest compute wait, and how many requests decided on a
shared match answer. A failed request is counted (`*_num_errors`), never dropped: an arm with an error has
`pull_over_recompute` None and `target_met` False (`summarize`); an arm with no served request has None
percentiles.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpool.hashing import hash_blocks
from kvpool.report import write_report

ARMS = ("recompute", "pull")


TARGET_PULL_OVER_RECOMPUTE = 1.0  # pull p50 <= recompute p50


def _quantile(values: list[float], q: float) -> float | None:
    return float(np.quantile(np.asarray(values), q)) if values else None


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """Set environment entries in this process (the in-process node reads them), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _burst(
    rt: Any, ns: bytes, prompts: list[list[int]], *, use_cache: bool, arm: str
) -> list[dict[str, Any]]:
    """Fire one request per prompt at once; returns one record per request."""
    block_size = rt.runner.layout.block_size
    hashed = [hash_blocks(ns, p, block_size) for p in prompts]
    start = threading.Barrier(len(prompts) + 1)
    records: list[dict[str, Any]] = [{} for _ in prompts]
    t0 = 0.0

    def one(i: int) -> None:
        start.wait()
        rid = f"{arm}{i}"
        try:
            loaded = rt.connector.load_prefix(
                ns, prompts[i], hashed[i], count_hit=True, request_id=rid, use_cache=use_cache
            )
            t_loaded = time.perf_counter()
            with rt.model_lock:
                t_model = time.perf_counter()
                rt.compute_prompt(prompts[i], loaded)
            t_end = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - a failed request is a record, not a crashed burst
            records[i] = {"arm": arm, "request": i, "error": str(exc)}
            return
        s = loaded.stats
        records[i] = {
            "arm": arm,
            "request": i,
            "ttft_s": t_end - t0,
            "load_s": t_loaded - t0,
            "model_wait_s": t_model - t_loaded,
            "compute_s": t_end - t_model,
            "decision": s.decision if use_cache else "recompute",
            "reason": s.reason,
            "reused_tokens": s.num_reused_tokens,
            "pulled_bytes": s.pulled_bytes,
            "pull_s": s.pull_s,
            "pulls_in_flight_seen": s.num_pulls_in_flight,
            "queued_bytes_seen": s.queued_bytes,
            "compute_wait_s_seen": s.compute_wait_s,
            "shared_match": s.shared_match,
            "predicted_pull_s": s.predicted_pull_s,
            "predicted_recompute_s": s.predicted_recompute_s,
        }

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    return records


def _arm_summary(records: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    """One arm's figures over its served requests; its failed ones counted in `<arm>_num_errors` (and
    `<arm>_num_requests` counts both). None percentiles when no request was served."""
    mine = [r for r in records if r["arm"] == arm]
    ok = [r for r in mine if "ttft_s" in r]
    ttft = [r["ttft_s"] for r in ok]
    return {
        f"{arm}_num_requests": len(mine),
        f"{arm}_num_errors": len(mine) - len(ok),
        f"{arm}_ttft_p50_s": statistics.median(ttft) if ttft else None,
        f"{arm}_ttft_p90_s": _quantile(ttft, 0.9),
        f"{arm}_ttft_max_s": max(ttft, default=None),
        f"{arm}_load_p50_s": statistics.median(r["load_s"] for r in ok) if ok else None,
        f"{arm}_compute_mean_s": statistics.mean(r["compute_s"] for r in ok) if ok else None,
        f"{arm}_decisions": dict(Counter(r["decision"] for r in ok)),
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured figures of both arms (the `warmup*` arms left out): per arm `_arm_summary`, then
    `pull_over_recompute` = pull p50 / recompute p50, None when either arm had an error or served nothing;
    `target_met` (bool): that ratio is known and <= `TARGET_PULL_OVER_RECOMPUTE`; and what the pull arm's
    decisions saw."""
    s: dict[str, Any] = {}
    for arm in ARMS:
        s |= _arm_summary(records, arm)
    pull, rec = s["pull_ttft_p50_s"], s["recompute_ttft_p50_s"]
    clean = s["pull_num_errors"] == 0 and s["recompute_num_errors"] == 0
    ratio = pull / rec if clean and pull is not None and rec else None
    s["pull_over_recompute"] = ratio
    s["target_pull_over_recompute"] = TARGET_PULL_OVER_RECOMPUTE
    s["target_met"] = ratio is not None and ratio <= TARGET_PULL_OVER_RECOMPUTE
    pulls = [r for r in records if r["arm"] == "pull" and "ttft_s" in r]
    s["max_pulls_in_flight_seen"] = max((r["pulls_in_flight_seen"] for r in pulls), default=0)
    s["max_compute_wait_seen_s"] = max((r["compute_wait_s_seen"] for r in pulls), default=0.0)
    s["pulled_bytes_total"] = sum(r["pulled_bytes"] for r in pulls)
    s["pull_shared_matches"] = sum(1 for r in pulls if r["shared_match"])  # decided with no call
    return s


def run_burst(
    *,
    burst: int = 50,
    prefix_tokens: int = 256,
    question_tokens: int = 16,
    block_size: int = 64,
    warmup_bursts: int = 1,
    rounds: int = 3,
    model_dir: str | None = None,
    json_out: Path | None = None,
) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the summary."""
    from kvpool.bench.procs import pool_only_spec
    from kvpool.bench.ttft import check_prompt_fits
    from kvpool.cluster.local import LocalCluster
    from kvpool.model import ModelRunner
    from kvpool.serving.common import ServingSettings
    from kvpool.serving.runtime import NodeRuntime

    check_prompt_fits(prefix_tokens + question_tokens, model_dir)
    console = Console()
    layout = ModelRunner.load(model_dir, device="cpu", block_size=block_size).layout
    rng = np.random.default_rng(2026)
    vocab = 256
    prefix = [int(t) for t in rng.integers(3, vocab, size=prefix_tokens)]

    def prompts() -> list[list[int]]:
        return [prefix + [int(t) for t in rng.integers(3, vocab, size=question_tokens)] for _ in range(burst)]

    tcp = {"UCX_TLS": "tcp", "KVPOOL_SHARE_SEGMENT": "false"}  # as across hosts
    seg = max(256 * 2**20, 4 * (prefix_tokens + question_tokens) * layout.token_nbytes)
    spec = pool_only_spec(layout, block_size=block_size, model_dir=model_dir, segment_bytes=seg, env=tcp)
    records: list[dict[str, Any]] = []
    learned_bytes_per_s = 0.0
    with LocalCluster(spec) as cluster, _env(tcp | {"KVPOOL_FORCE_DECISION": "auto"}):
        settings = ServingSettings(
            master=cluster.master_address,
            node_id="burst0",
            model=model_dir,
            block_size=block_size,
            local_tier_bytes=0,
            metrics=False,
        )
        rt = NodeRuntime.start(settings, role="prefill")
        try:
            rt.attach_link("127.0.0.1:1", None)  # never called back: this node serves no RPCs
            ns = rt.namespace("")
            warm = prompts()[0]
            hashes = hash_blocks(ns, warm, block_size)
            loaded = rt.connector.load_prefix(ns, warm, hashes, count_hit=False, use_cache=False)
            _logits, full = rt.compute_prompt(warm, loaded)
            n_full = len(hashes)
            rt.connector.publish(ns, hashes, rt.runner.blocks_from_prefix(full, 0, n_full), start_block=0)
            for i in range(warmup_bursts):
                console.print(f"warm-up pull burst {i + 1} of {warmup_bursts} (not measured)")
                records += _burst(rt, ns, prompts(), use_cache=True, arm=f"warmup{i}")
            learned = rt.connector.pulls.contended_rates()  # the one store's link
            learned_bytes_per_s = max(learned.values(), default=0.0)
            for r in range(rounds):  # interleaved, the order alternating: drift on the host hits both arms
                for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                    console.print(
                        f"[bold]{arm} burst[/] (round {r + 1} of {rounds}): {burst} requests at once"
                    )
                    got = _burst(rt, ns, prompts(), use_cache=arm == "pull", arm=arm)
                    records += [rec | {"round": r} for rec in got]
            queue = rt.connector.forwards
            forwards_left = len(queue) if queue is not None else 0  # every forward released: 0
        finally:
            rt.close()
    summary: dict[str, Any] = {
        "burst": burst,
        "prefix_tokens": prefix_tokens,
        "question_tokens": question_tokens,
        "block_nbytes": layout.block_nbytes,
        "warmup_bursts": warmup_bursts,
        "contended_bytes_per_s": learned_bytes_per_s,  # learned by the warm-up (0.0: none)
        "rounds": rounds,
    }
    summary |= summarize(records)
    summary["forwards_left"] = forwards_left
    _print(console, summary)
    write_report(json_out, "burst", records, summary)
    return summary


def _f(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def _print(console: Console, s: dict[str, Any]) -> None:
    table = Table(title=f"Burst of {s['burst']} requests on one {s['prefix_tokens']}-token prefix (UCX tcp)")
    for col in ("burst", "TTFT p50 s", "TTFT p90 s", "TTFT max s", "decisions", "errors"):
        table.add_column(col, justify="left" if col in ("burst", "decisions") else "right")
    for arm in ARMS:
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(s[f"{arm}_decisions"].items()))
        errors = s[f"{arm}_num_errors"]
        table.add_row(
            arm,
            _f(s[f"{arm}_ttft_p50_s"]),
            _f(s[f"{arm}_ttft_p90_s"]),
            _f(s[f"{arm}_ttft_max_s"]),
            decisions,
            f"[red]{errors}[/red]" if errors else "0",
        )
    console.print(table)
    verdict = "[green]target met[/green]" if s["target_met"] else "[red]target NOT met[/red]"
    ratio = _f(s["pull_over_recompute"]) if s["pull_over_recompute"] is not None else "n/a (an arm failed)"
    load_p50 = s["pull_load_p50_s"]
    console.print(
        f"pull/recompute p50 = {ratio} (target <= {TARGET_PULL_OVER_RECOMPUTE:g}, no failed request): "
        f"{verdict}; most pulls a decision saw in flight: {s['max_pulls_in_flight_seen']}; pulled "
        f"{s['pulled_bytes_total'] / 2**20:.1f} MiB; {s['pull_shared_matches']} decided on a shared match "
        f"answer; load p50 {_f(None if load_p50 is None else load_p50 * 1e3, '.1f')} ms"
    )
