"""`kvpool bench failover`: kill -9 the leading master under steady serving traffic.

A real pool in high availability (`kvpool.bench.failover_cluster`: a single-node etcd, `masters` processes
of `kvpool master --etcd` with lease `lease_ttl_s`, one `kvpool store` given all of them) and one serving
node in this process, built as a prefill node builds it (`NodeRuntime`, its master the comma list of all
masters, its local tier off so every hit comes from the pool). Its requests run as the prefill node's do:
register the namespace, match and pull the cached prefix, prefill the rest, publish the new full blocks.

Traffic: one closed loop at about `rate` requests/s over `prefixes` x `questions` distinct prompts (a
shared prefix of `prefix_tokens` plus a question of `question_tokens`), so almost every request reuses a
cached prefix. Each prompt's greedy output (`max_tokens` tokens: the first from the prefill, the rest
decoded on its KV) is computed cold (no cache) before the traffic starts; every request generates the same
number of tokens on the KV it loaded, and an output that differs from the cold one at any position is a
wrong output (`grade_output`). After `warmup_s` the leader is killed (SIGKILL: its lease lapses
after the TTL) and the traffic goes on for `after_s`.

Figures (all from the kill, seconds):
- `failover_s`: until the first match answered OK (any master answering a match leads: standbys refuse
  it), probed every 50 ms by a client given the same master list;
- `hits_back_s`: until the hit rate is back at its pre-kill level: the first request, after the first one
  that hit less than 95 % of the pre-kill mean (the last 5 s before the kill), that begins a run of
  `BACK_RUN` requests all at >= 95 % of it (0.0: the hit rate never dipped);
- `ttft_p99_before_s` over the requests of the 5 s before the kill, `ttft_p99_during_s` over those from
  the kill to the hits' return (or to the end when they never return);
- `failed_requests` (a request that raised), `wrong_outputs` (requests whose greedy output differs from
  the cold one), `wrong_tokens` (the differing positions over all requests), `publish_failed`, `failovers`
  (leader epoch changes seen by a poller every 0.5 s; 1 expected).

`target_met` (a boolean, `kvpool.bench.failover_report.targets`): no failed request, no wrong output, and
for a kill `failover_s` <= TTL + 1 s and `hits_back_s` <= `failover_s` + 3 s; for a soak no spurious
failover.

`soak_s` > 0: that long of traffic and no kill; `spurious_failovers` counts leader epoch changes (0
expected).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.hashing import hash_blocks
from kvpool.report import write_report

BACK_RUN = 3
BEFORE_WINDOW_S = 5.0
PROBE_INTERVAL_S = 0.05


def greedy_output(runner: Any, logits: Any, prefix: Any, max_tokens: int) -> list[int]:
    """`max_tokens` greedy token ids: the first from a prompt's last `logits`, then one decode step each on
    the prompt's KV `prefix` (`ModelRunner.decode_step`); no stop token (the outputs are compared whole)."""
    import torch

    out = [int(torch.argmax(logits))]
    while len(out) < max_tokens:
        step_logits, caches = runner.decode_step([(prefix, out[-1])])
        prefix = caches[0]
        out.append(int(torch.argmax(step_logits[0])))
    return out


def grade_output(got: Sequence[int], cold: Sequence[int]) -> dict[str, Any]:
    """Compare a request's whole output with the cold reference: `right` (every token equal, same length),
    `wrong_tokens` (positions that differ, a missing or extra token counted as one), `first_wrong` (the
    first such position, None when right)."""
    n = max(len(got), len(cold))
    diff = [k for k in range(n) if k >= len(got) or k >= len(cold) or got[k] != cold[k]]
    return {"right": not diff, "wrong_tokens": len(diff), "first_wrong": diff[0] if diff else None}


def _p99(values: list[float]) -> float:
    return float(np.quantile(np.asarray(values), 0.99)) if values else 0.0


class EpochWatch:
    """Asks every master for its role every 0.5 s from its own thread; `epochs`: the leader epochs in the
    order seen (a master that answers "leader" names its own)."""

    def __init__(self, addresses: str) -> None:
        from kvpool.client import MasterClient

        self.epochs: list[int] = []
        self._clients = [MasterClient(a, timeout_s=0.3) for a in addresses.split(",")]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epoch-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for client in self._clients:
                try:
                    status = client.masters()
                except Exception:  # noqa: BLE001 - a dead master: the others answer
                    continue
                if status.role == "leader" and status.epoch not in self.epochs:
                    self.epochs.append(status.epoch)

    @property
    def changes(self) -> int:
        return max(0, len(self.epochs) - 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for client in self._clients:
            client.close()


class Traffic:
    """The closed request loop (its own thread); `records` one dict per request, times from `t0`."""

    def __init__(
        self, rt: Any, prompts: list[list[int]], cold: list[list[int]], rate: float, t0: float
    ) -> None:
        self.rt, self.prompts, self.cold, self.t0 = rt, prompts, cold, t0
        self.interval_s = 1.0 / rate
        self.records: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._rng = np.random.default_rng(30)
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        next_at = time.perf_counter()
        while not self._stop.is_set():
            i = int(self._rng.integers(len(self.prompts)))
            self.records.append(self._one(f"r{n}", i))
            n += 1
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.perf_counter()))
            next_at = max(next_at, time.perf_counter() - self.interval_s)  # no catch-up burst after a stall

    def _one(self, rid: str, i: int) -> dict[str, Any]:
        rt, tokens = self.rt, self.prompts[i]
        t_start = time.perf_counter()
        rec: dict[str, Any] = {"request": rid, "prompt": i, "t_s": t_start - self.t0}
        try:
            ns = rt.namespace("")
            hashes = hash_blocks(ns, tokens, rt.runner.layout.block_size)
            with rt.model_lock:
                loaded = rt.connector.load_prefix(ns, tokens, hashes, count_hit=True, request_id=rid)
                logits, full = rt.compute_prompt(tokens, loaded)
                ttft_s = time.perf_counter() - t_start
                out = greedy_output(rt.runner, logits, full, len(self.cold[i]))
            rec |= {
                "ttft_s": ttft_s,
                "hit": loaded.stats.num_reused_tokens / len(tokens),
                **grade_output(out, self.cold[i]),
                "decision": loaded.stats.decision,
                "reason": loaded.stats.reason,
            }
            rec["publish"], error = _publish(rt, ns, hashes, full, loaded, rid)
            if error:
                rec["publish_error"] = error
        except Exception as exc:  # noqa: BLE001 - a failed request is a record, not a crashed benchmark
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["done_s"] = time.perf_counter() - self.t0
        return rec

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _publish(
    rt: Any, ns: bytes, hashes: Sequence[bytes], full: Any, loaded: Any, rid: str
) -> tuple[str, str]:
    """Publish the full blocks the pool lacks, as the prefill node does: ("committed" | "publish_failed",
    the error or "")."""
    start = loaded.stats.num_pool_blocks
    if start >= len(hashes):
        return "committed", ""
    try:
        blocks = rt.runner.blocks_from_prefix(full, start, len(hashes))
        rt.connector.publish(
            ns, hashes, blocks, start_block=start, request_id=rid, flush_epoch=loaded.flush_epoch
        )
    except Exception as exc:  # noqa: BLE001 - a failed publish never fails the request
        return "publish_failed", f"{type(exc).__name__}: {exc}"
    return "committed", ""


def probe_failover(
    addresses: str, ns: bytes, hashes: Sequence[bytes], t_kill: float, give_up_s: float
) -> float:
    """Seconds from `t_kill` to the first match answered OK through a client on `addresses` (-1.0: none
    within `give_up_s`)."""
    from kvpool.client import MasterClient
    from kvpool.errors import KVPoolError

    with MasterClient(addresses, timeout_s=0.5) as c:
        while time.perf_counter() - t_kill < give_up_s:
            try:
                c.match(ns, hashes)
                return time.perf_counter() - t_kill
            except KVPoolError:
                time.sleep(PROBE_INTERVAL_S)
    return -1.0


def hits_back(records: list[dict[str, Any]], t_kill_s: float, level: float) -> float | None:
    """Seconds from the kill to the hits' return (see the module docstring); None: never back."""
    after = [r for r in records if r["t_s"] >= t_kill_s and "hit" in r]
    bar = 0.95 * level
    dip = next((k for k, r in enumerate(after) if r["hit"] < bar), None)
    if dip is None:
        return 0.0
    for k in range(dip + 1, len(after) - BACK_RUN + 1):
        if all(r["hit"] >= bar for r in after[k : k + BACK_RUN]):
            return float(after[k]["t_s"] - t_kill_s)
    return None


def summarize(
    records: list[dict[str, Any]], t_kill_s: float | None, failover_s: float | None
) -> dict[str, Any]:
    """The summary's request figures; `t_kill_s` None: a soak (no kill)."""
    ok = [r for r in records if "ttft_s" in r]
    s: dict[str, Any] = {
        "requests": len(records),
        "failed_requests": len(records) - len(ok),
        "wrong_outputs": sum(1 for r in ok if not r["right"]),
        "wrong_tokens": sum(r.get("wrong_tokens", 0 if r["right"] else 1) for r in ok),
        "publish_failed": sum(1 for r in ok if r["publish"] == "publish_failed"),
        "hit_rate": float(np.mean([r["hit"] for r in ok])) if ok else 0.0,
        "ttft_p99_s": _p99([r["ttft_s"] for r in ok]),
    }
    if t_kill_s is None:
        return s
    before = [r for r in ok if t_kill_s - BEFORE_WINDOW_S <= r["t_s"] < t_kill_s]
    level = float(np.mean([r["hit"] for r in before])) if before else 0.0
    back = hits_back(records, t_kill_s, level)
    end = t_kill_s + (back if back is not None else float("inf"))
    if failover_s is not None:
        end = max(end, t_kill_s + failover_s)
    during = [r for r in ok if t_kill_s <= r["t_s"] <= end]
    s |= {
        "hit_rate_before": level,
        "hits_back_s": back,
        "ttft_p99_before_s": _p99([r["ttft_s"] for r in before]),
        "ttft_p99_during_s": _p99([r["ttft_s"] for r in during]),
        "requests_during": len(during),
    }
    return s


def make_prompts(
    prefixes: int, questions: int, prefix_tokens: int, question_tokens: int, vocab: int
) -> list[list[int]]:
    """`prefixes` x `questions` distinct prompts: each prefix with each question (fixed seed)."""
    rng = np.random.default_rng(2026)
    shared = [[int(t) for t in rng.integers(3, vocab, size=prefix_tokens)] for _ in range(prefixes)]
    return [
        p + [int(t) for t in rng.integers(3, vocab, size=question_tokens)]
        for p in shared
        for _ in range(questions)
    ]


def run_failover(
    *,
    masters: int = 3,
    lease_ttl_s: int = 5,
    warmup_s: float = 10.0,
    after_s: float = 15.0,
    soak_s: float = 0.0,
    rate: float = 8.0,
    prefixes: int = 4,
    questions: int = 4,
    prefix_tokens: int = 256,
    question_tokens: int = 16,
    block_size: int = 64,
    max_tokens: int = 8,
    json_out: Path | None = None,
    png_out: Path | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns the summary. Raises `RuntimeError` when the
    pool does not start, `FailedPrecondition` (naming `make etcd`) when no etcd binary is found."""
    from kvpool.bench.failover_cluster import ha_pool
    from kvpool.bench.failover_report import plot, print_summary, target_met
    from kvpool.model import ModelRunner
    from kvpool.serving.common import ServingSettings
    from kvpool.serving.runtime import NodeRuntime

    layout = ModelRunner.load(None, device="cpu", block_size=block_size).layout
    prompts = make_prompts(prefixes, questions, prefix_tokens, question_tokens, vocab=256)
    seg_mib = max(64, 4 * len(prompts) * (prefix_tokens + question_tokens) * layout.token_nbytes >> 20)
    with ha_pool(
        num_masters=masters, lease_ttl_s=lease_ttl_s, layout=layout.fingerprint(), segment=f"{seg_mib}MiB"
    ) as pool:
        say(
            f"etcd {pool.etcd.endpoint}, {masters} masters (lease {lease_ttl_s} s), a store: {pool.addresses}"
        )
        settings = ServingSettings(  # the whole list: the node's master link and clients follow the leader
            master=pool.addresses,
            node_id="failover0",
            block_size=block_size,
            local_tier_bytes=0,
            metrics=False,
        )
        rt = NodeRuntime.start(settings, role="prefill")
        watch: EpochWatch | None = None
        traffic: Traffic | None = None
        try:
            rt.attach_link("127.0.0.1:1", None)  # never called back: this node serves no RPCs
            ns = rt.namespace("")
            cold = []
            for tokens in prompts:
                hashes = hash_blocks(ns, tokens, block_size)
                loaded = rt.connector.load_prefix(ns, tokens, hashes, count_hit=False, use_cache=False)
                logits, full = rt.compute_prompt(tokens, loaded)
                cold.append(greedy_output(rt.runner, logits, full, max_tokens))
            probe_hashes = hash_blocks(ns, prompts[0], block_size)
            watch = EpochWatch(pool.addresses)
            t0 = time.perf_counter()
            traffic = Traffic(rt, prompts, cold, rate, t0)
            t_kill_s: float | None = None
            failover_s: float | None = None
            if soak_s > 0:
                say(f"soak: {soak_s:.0f} s of traffic, no kill")
                time.sleep(soak_s)
            else:
                say(f"warm-up: {warmup_s:.0f} s of traffic")
                time.sleep(warmup_s)
                leader = pool.leader()
                say(f"kill -9 the leader {leader.grpc_address}")
                t_kill = time.perf_counter()
                pool.kill(leader)
                t_kill_s = t_kill - t0
                got = probe_failover(pool.addresses, ns, probe_hashes, t_kill, give_up_s=after_s)
                failover_s = got if got >= 0 else None
                time.sleep(max(0.0, after_s - (time.perf_counter() - t_kill)))
            traffic.stop()
        finally:
            if traffic is not None:
                traffic.stop()
            if watch is not None:
                watch.stop()
            rt.close()
    records = traffic.records
    summary: dict[str, Any] = {
        "masters": masters,
        "lease_ttl_s": lease_ttl_s,
        "rate": rate,
        "prompts": len(prompts),
        "prefix_tokens": prefix_tokens,
        "question_tokens": question_tokens,
        "max_tokens": max_tokens,
        "soak_s": soak_s,
        "warmup_s": warmup_s if soak_s <= 0 else 0.0,
        "after_s": after_s if soak_s <= 0 else 0.0,
        "kill_at_s": t_kill_s,
        "failover_s": failover_s,
        "epochs": watch.epochs,
    }
    summary |= summarize(records, t_kill_s, failover_s)
    if soak_s > 0:
        summary["spurious_failovers"] = watch.changes
    else:
        summary["failovers"] = watch.changes
    summary["target_met"] = target_met(summary)
    print_summary(summary)
    if png_out is not None:
        plot(records, summary, png_out)
    write_report(json_out, "failover", records, summary)
    return summary
