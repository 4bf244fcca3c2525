"""The crossover benchmark's measurement: the grid's cases (`ModelCase`, `LinkCase`), the cluster whose store
may sit in another network namespace and whose prefill node restarts per link (`BenchCluster`), the
prefill-only TTFT caller (`PrefillCaller`) (both in `kvpool.bench.crossover_cluster`), and a `Job` (one cluster's cells) run here (`run_job`) or in a
child process inside a namespace (`run_job_in_netns`: `python -m kvpool.bench.crossover_measure JOB OUT`).
Each cell's record carries the measured medians, the node's own predictions and `crossover_analysis`'s
reconstructed choice and score.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool.bench.crossover_analysis import predict_cell, score_cell
from kvpool.bench.crossover_cluster import BenchCluster, PrefillCaller, wait_recompute_model
from kvpool.bench.procs import pool_only_spec
from kvpool.cost import RecomputeModel
from kvpool.model.embedded import EmbeddedSpec

BASE_SEED = 2026


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCase:
    """One model of the grid: its embedded spec, the prefix lengths on unthrottled and throttled links."""

    name: str
    spec: EmbeddedSpec
    prefixes: tuple[int, ...]
    throttled_prefixes: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkCase:
    """`kind` is shm | tcp | tbf; `rate_bits_per_s` is the configured throttle (tbf only, display only)."""

    name: str
    kind: str
    rate_bits_per_s: float | None = None

    @property
    def ucx_tls(self) -> str:
        return "sm,self" if self.kind == "shm" else "tcp"


def tbf_link(bits_per_s: float) -> LinkCase:
    label = f"{bits_per_s / 1e9:g}Gbit" if bits_per_s >= 1e9 else f"{bits_per_s / 1e6:.0f}Mbit"
    return LinkCase(name=f"tbf-{label}", kind="tbf", rate_bits_per_s=bits_per_s)


# ---------------------------------------------------------------- measuring


@dataclass(slots=True, kw_only=True)
class Job:
    """One cluster's measurements (serialisable: it crosses into the namespace worker as JSON)."""

    model: dict[str, Any]
    links: list[dict[str, Any]]
    reps: int
    question_tokens: int
    margin: float
    block_size: int = 64
    cache_dir: str | None = None
    host: str = "127.0.0.1"
    netns: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _tokens(prefix_tokens: int, question_tokens: int, vocab: int) -> tuple[list[int], list[list[int]]]:
    import numpy as np

    rng = np.random.default_rng(BASE_SEED)
    base = [int(t) for t in rng.integers(3, vocab, size=prefix_tokens)]
    questions = [[int(t) for t in rng.integers(3, vocab, size=question_tokens)] for _ in range(16)]
    return base, questions


def run_job(job: Job, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Start one cluster for `job.model`, measure every (link, prefix) cell; returns the records."""
    from kvpool.bench.netns import PairAddresses, ThrottledPair
    from kvpool.model import ModelRunner, embedded_model_dir

    case = ModelCase(
        name=job.model["name"],
        spec=EmbeddedSpec(**job.model["spec"]),
        prefixes=tuple(job.model["prefixes"]),
        throttled_prefixes=tuple(job.model["throttled_prefixes"]),
    )
    links = [LinkCase(**lk) for lk in job.links]
    model_dir = str(embedded_model_dir(case.spec))
    runner = ModelRunner.load(model_dir, device="cpu", block_size=job.block_size)
    layout, token_nbytes, vocab = runner.layout, runner.layout.token_nbytes, min(runner.vocab_size, 256)
    del runner
    pair = ThrottledPair.existing(PairAddresses(**job.netns)) if job.netns else None
    prefixes_of = {lk.name: (case.throttled_prefixes if lk.kind == "tbf" else case.prefixes) for lk in links}
    max_prefix = max(max(p) for p in prefixes_of.values())
    base, questions = _tokens(max_prefix, job.question_tokens, vocab)
    seg = max(256 * 2**20, 2 * (max_prefix + 64) * token_nbytes)
    env = {
        "KVPOOL_LOCAL_TIER_BYTES": "0",
        "KVPOOL_PULL_TIMEOUT_S": "900",
        "KVPOOL_COST_MARGIN": str(job.margin),
        "KVPOOL_FORCE_DECISION": "pull",
    } | ({"KVPOOL_CACHE_DIR": job.cache_dir} if job.cache_dir else {})
    tls = {lk.ucx_tls for lk in links}
    if len(tls) != 1:
        raise ValueError(f"one job, one UCX_TLS: {sorted(tls)}")
    # every node, the store included, is held to the link's transports: a store allowed shared memory
    # could serve a same-host puller through it, around the tcp link (and its throttle)
    env["UCX_TLS"] = tls.pop()
    if "sm" not in env["UCX_TLS"].split(","):  # nor map its segment (same-host reads bypass UCX entirely)
        env["KVPOOL_SHARE_SEGMENT"] = "false"
    spec = pool_only_spec(
        layout, block_size=job.block_size, model_dir=model_dir, segment_bytes=seg, env=env, host=job.host
    )
    records: list[dict[str, Any]] = []
    keep = os.environ.get("KVPOOL_BENCH_LOG_DIR")  # keep the nodes' logs there (debugging)
    log_dir = Path(tempfile.mkdtemp(prefix=f"{case.name}-", dir=keep)) if keep else None
    cluster = BenchCluster(
        spec,
        store_netns=pair.addr.ns_b if pair else None,
        store_host=pair.addr.b if pair else None,
        log_dir=log_dir,
    )
    with cluster:
        published = False
        for link in links:
            if pair is not None and published:
                pair.set_rate(link.rate_bits_per_s)
            t0 = time.perf_counter()
            proc = cluster.start_prefill({"UCX_TLS": link.ucx_tls})
            call = PrefillCaller(proc.info["grpc_address"])
            try:
                if not published:  # publish the longest prefix once, before any throttle
                    _, st = call(base + questions[0], use_cache=True, publish=True, rid="publish")
                    if st.get("publish_status") != "committed":
                        raise RuntimeError(f"publishing the shared prefix failed: {st.get('publish_status')}")
                    published = True
                    if pair is not None:  # throttle, then a fresh node probes the throttled link
                        call.close()
                        pair.set_rate(link.rate_bits_per_s)
                        proc = cluster.start_prefill({"UCX_TLS": link.ucx_tls})
                        call = PrefillCaller(proc.info["grpc_address"])
                # warm-up: connect + link probe, first forwards
                call(
                    base[: min(prefixes_of[link.name])] + questions[1],
                    use_cache=True,
                    publish=False,
                    rid="warm-pull",
                )
                call(
                    base[: min(prefixes_of[link.name])] + questions[1],
                    use_cache=False,
                    publish=False,
                    rid="warm-rec",
                )
                _, st = call(
                    base[: min(prefixes_of[link.name])] + questions[1],
                    use_cache=True,
                    publish=False,
                    rid="check",
                )
                if st.get("num_reused_tokens", 0) == 0:
                    log(
                        f"[{case.name}] link {link.name}: the prefix is no longer pullable (a failed connect or "
                        "probe reported the replica bad); its cells will fail"
                    )
                recompute = wait_recompute_model(cluster, proc.name)
                log(
                    f"[{case.name}] link {link.name}: prefill up and warm in {time.perf_counter() - t0:.1f} s"
                )
                for prefix in prefixes_of[link.name]:
                    records.append(
                        _measure_cell(call, case, link, prefix, base, questions, job, recompute, token_nbytes)
                    )
                    r = records[-1]
                    log(
                        f"[{case.name}] {link.name:>12} prefix {prefix:>5}: pull {r['pull_ttft_s']:.3f} s, "
                        f"recompute {r['recompute_ttft_s']:.3f} s, choice {r.get('choice', '?')}"
                    )
            finally:
                call.close()
    return records


def _measure_cell(
    call: PrefillCaller,
    case: ModelCase,
    link: LinkCase,
    prefix: int,
    base: list[int],
    questions: list[list[int]],
    job: Job,
    recompute: RecomputeModel,
    token_nbytes: int,
) -> dict[str, Any]:
    pulls: list[float] = []
    recs: list[float] = []
    node: list[dict[str, Any]] = []
    ok = True
    for i in range(job.reps):
        prompt = base[:prefix] + questions[2 + i % 14]
        ttft, st = call(prompt, use_cache=True, publish=False, rid=f"{link.name}-{prefix}-pull{i}")
        if (
            st.get("decision") != "pull"
            or st.get("num_reused_tokens") != prefix
            or st.get("num_failed_blocks")
        ):
            ok = False
        pulls.append(ttft)
        node.append(st)
        ttft, _ = call(prompt, use_cache=False, publish=False, rid=f"{link.name}-{prefix}-rec{i}")
        recs.append(ttft)
    prompt_tokens = prefix + job.question_tokens
    pred_load = statistics.median(s["predicted_pull_s"] for s in node)
    rec: dict[str, Any] = {
        "model": case.name,
        "link": link.name,
        "link_kind": link.kind,
        "configured_rate_mbit": link.rate_bits_per_s / 1e6 if link.rate_bits_per_s else None,
        "prefix_tokens": prefix,
        "question_tokens": job.question_tokens,
        "prompt_tokens": prompt_tokens,
        "kv_bytes": prefix * token_nbytes,
        "token_nbytes": token_nbytes,
        "pull_ttft_s": statistics.median(pulls),
        "recompute_ttft_s": statistics.median(recs),
        "pull_samples_s": pulls,
        "recompute_samples_s": recs,
        "node_pull_s": statistics.median(s["pull_s"] for s in node),
        "node_match_s": statistics.median(s["match_s"] for s in node),
        "predicted_load_s": pred_load,
        "margin": job.margin,
        "recompute_model": {
            "overhead_s": recompute.overhead_s,
            "per_token_s": recompute.per_token_s,
            "per_pair_s": recompute.per_pair_s,
        },
        "ok": ok,
    }
    node_rec_all = statistics.median(s["predicted_recompute_s"] for s in node)
    node_rest = statistics.median(s.get("predicted_compute_s", 0.0) for s in node)
    rec["node_predicted_recompute_s"], rec["node_predicted_compute_s"] = node_rec_all, node_rest
    rec |= predict_cell(recompute, pred_load, prompt_tokens, prefix, job.margin, node_rec_all, node_rest)
    rec |= score_cell(rec["pull_ttft_s"], rec["recompute_ttft_s"], rec["choice"])
    return rec


def worker_main(job_path: str, out_path: str) -> None:
    job = Job(**json.loads(Path(job_path).read_text()))
    records = run_job(job, log=lambda m: print(m, file=sys.stderr, flush=True))
    Path(out_path).write_text(json.dumps(records))


def run_job_in_netns(job: Job, pair: Any, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run `job` in a child process inside namespace A (its store node goes to namespace B)."""
    from kvpool.rpc.process import die_with_parent

    job.host = pair.addr.a
    job.netns = asdict(pair.addr)
    with tempfile.TemporaryDirectory(prefix="kvpool-xover-") as tmp:
        jp, op = Path(tmp) / "job.json", Path(tmp) / "out.json"
        jp.write_text(json.dumps(asdict(job)))
        cmd = [
            "ip",
            "netns",
            "exec",
            pair.addr.ns_a,
            sys.executable,
            "-m",
            "kvpool.bench.crossover_measure",
            str(jp),
            str(op),
        ]
        proc = subprocess.Popen(
            die_with_parent(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        assert proc.stderr is not None
        tail: list[str] = []
        for line in proc.stderr:
            line = line.rstrip()
            if line.startswith("["):
                log(line)
            tail = (tail + [line])[-40:]
        if proc.wait() != 0:
            raise RuntimeError("namespace worker failed:\n" + "\n".join(tail))
        records: list[dict[str, Any]] = json.loads(op.read_text())
        return records


if __name__ == "__main__":  # the namespace worker: python -m kvpool.bench.crossover_measure JOB.json OUT.json
    worker_main(sys.argv[1], sys.argv[2])
