"""`kvpool bench crossover`: where pulling a cached prefix beats recomputing it, and does the cost model know?

Grid: models (one cluster each: a pool holds one KV layout) × links × shared-prefix lengths. Links:
  - `shm`: store on the same host (`UCX_TLS=sm,self`): block bytes copied from the store's mapped segment,
    control messages over UCX shared memory (`transfer/shared_segment.py`; the other links turn it off);
  - `tcp`: UCX over loopback tcp (`UCX_TLS=tcp`);
  - `tbf-<rate>`: UCX tcp across a veth pair between two network namespaces the benchmark creates, the
    pair throttled with `tc tbf` (root only, `kvpool.bench.netns`); the store node runs in the "remote"
    namespace, master and prefill in the other. Rates default to multiples of the model's break-even
    bandwidth (KV bytes per token ÷ calibrated recompute seconds per token), so cells fall on both sides.

Every cell measures, interleaved, `reps` times each: the real TTFT with the prefix pulled from the pool
(the prefill node runs with `KVPOOL_FORCE_DECISION=pull`) and with it recomputed (`use_cache=False`), and
records the cost model's predictions. The prefill node is restarted per link, so its link estimate comes
from its own connect-time probe and real transfers, never from the throttle setting.

The cost model's choice under `auto` is reconstructed exactly from the node's own figures: `decide_reuse`
minimises `(1+m)·load(k) + compute(k)` over k; load is affine in k and compute concave in k (the attention
pairs of `n_new = P − k·b` tokens on `k·b` cached ones fall as `−(k·b)²/2`), so the minimum is at k = 0 or
k = h, and auto pulls iff `(1+m)·load(h) + t_rec(P − h·b | h·b) < t_rec(P | 0)`; `load(h)` is the forced
node's `predicted_pull_s`, `t_rec` its calibrated `RecomputeModel` (heartbeat figures), m its margin.

Scores: a cell is right when the choice was the faster option, or the two medians are within 10 %;
`decision_accuracy` = right cells / cells; `mean_regret` = mean(chosen / best − 1).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.cluster.process import RoleProcess
from kvpool.cost import RecomputeModel
from kvpool.model.embedded import DEFAULT_SPEC, EmbeddedSpec

TOLERANCE = 0.10
"""Cells whose two measured TTFTs are within 10 % count as right either way."""
DEFAULT_MARGIN = 0.1
RATE_MULTIPLIERS = (0.5, 0.75, 1.33, 2.0)
MIN_RATE_BITS = 10e6
"""The transport probes a new peer with 2 x 4 MiB inside its 15 s connect deadline: below ~5 Mb/s the connect
fails and the replica is reported bad (the master then drops it), so auto rates stay above 10 Mb/s."""
"""Throttle rates as multiples of the model's break-even bandwidth; plus `FAST_RATE`."""
FAST_RATE_BITS = 1e9
BASE_SEED = 2026


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelCase:
    """One model of the grid: its embedded spec, the prefix lengths on unthrottled and throttled links."""

    name: str
    spec: EmbeddedSpec
    prefixes: tuple[int, ...]
    throttled_prefixes: tuple[int, ...]


LARGER_SPEC = EmbeddedSpec(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1376)
"""8 layers, hidden 512, GQA 8/4 (head_dim 64): 16 KiB of KV per token, ~4x the default's FLOP per token.
(12 layers / hidden 768 costs ~14 ms per token on a shared 2-core CPU: 8K tokens would not fit the budget.)"""

FULL_MODELS = (
    ModelCase(name="default-l4-h256", spec=DEFAULT_SPEC, prefixes=(64, 512, 2048, 8192),
              throttled_prefixes=(64, 512, 2048)),
    ModelCase(name="larger-l8-h512", spec=LARGER_SPEC, prefixes=(64, 256, 1024), throttled_prefixes=(64, 256, 1024)),
)  # fmt: skip
QUICK_MODELS = (
    ModelCase(name="default-l4-h256", spec=DEFAULT_SPEC, prefixes=(64, 256), throttled_prefixes=(64,)),
)


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


# ---------------------------------------------------------------- the cost model's view (pure)


def recompute_model_of(load: Any) -> RecomputeModel:
    """A node's `RecomputeModel` from its heartbeat figures (`kvpool.client.NodeLoad`)."""
    return RecomputeModel(
        overhead_s=max(0.0, load.recompute_overhead_s),
        per_token_s=max(0.0, load.recompute_s_per_token),
        per_pair_s=max(0.0, load.recompute_s_per_token_ctx),
    )


def predict_cell(
    model: RecomputeModel,
    predicted_load_s: float,
    prompt_tokens: int,
    reused_tokens: int,
    margin: float,
    node_recompute_all_s: float | None = None,
    node_compute_rest_s: float | None = None,
) -> dict[str, Any]:
    """Predicted TTFT pulled / recomputed and auto's choice (see the module docstring).

    The node corrects its model online (kvpool.cost.online), so the heartbeat's model may lag the one it
    decided with. With both of the node's own per-request predictions (`node_recompute_all_s`: the whole
    prompt; `node_compute_rest_s`: the rest once every hit block is loaded) the choice is exactly the
    node's; with only the first, the heartbeat model is rescaled to agree with it.
    """
    n_new = max(1, prompt_tokens - reused_tokens)
    if node_recompute_all_s and node_compute_rest_s:
        pull = (1.0 + margin) * predicted_load_s + node_compute_rest_s < node_recompute_all_s
        return {
            "predicted_pull_ttft_s": predicted_load_s + node_compute_rest_s,
            "predicted_recompute_ttft_s": node_recompute_all_s,
            "choice": "pull" if pull else "recompute",
        }
    recompute_all = model.t_recompute_s(prompt_tokens, 0)
    if node_recompute_all_s and recompute_all > 0:
        scale = node_recompute_all_s / recompute_all
        model = replace(model, overhead_s=model.overhead_s * scale, per_token_s=model.per_token_s * scale,
                        per_pair_s=model.per_pair_s * scale)  # fmt: skip
        recompute_all = model.t_recompute_s(prompt_tokens, 0)
    compute_rest = model.t_recompute_s(n_new, prompt_tokens - n_new)
    pull = (1.0 + margin) * predicted_load_s + compute_rest < recompute_all
    return {
        "predicted_pull_ttft_s": predicted_load_s + compute_rest,
        "predicted_recompute_ttft_s": recompute_all,
        "choice": "pull" if pull else "recompute",
    }


def breakeven_bits_per_s(model: RecomputeModel, prefix_tokens: int, question_tokens: int, token_nbytes: int,
                         alpha_s: float = 0.0) -> float:  # fmt: skip
    """Bandwidth at which pulling the prefix costs as much as recomputing it (inf if it never does)."""
    saved = model.t_recompute_s(prefix_tokens + question_tokens, 0) - model.t_recompute_s(
        question_tokens, prefix_tokens
    )
    budget = saved - alpha_s
    return 8.0 * prefix_tokens * token_nbytes / budget if budget > 0 else math.inf


def score_cell(
    pull_s: float, recompute_s: float, choice: str, tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """Right/wrong and regret of one choice given the two measured medians."""
    best = min(pull_s, recompute_s)
    chosen = pull_s if choice == "pull" else recompute_s
    close = abs(pull_s - recompute_s) <= tolerance * best
    return {
        "faster": "pull" if pull_s < recompute_s else "recompute",
        "within_tolerance": close,
        "right": close or chosen == best,
        "regret": chosen / best - 1.0 if best > 0 else 0.0,
    }


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`decision_accuracy`, `mean_regret` and the side counts over scored cells."""
    cells = [r for r in records if r.get("ok")]
    n = len(cells)
    return {
        "num_cells": n,
        "num_failed_cells": len(records) - n,
        "decision_accuracy": sum(r["right"] for r in cells) / n if n else 0.0,
        "mean_regret": sum(r["regret"] for r in cells) / n if n else 0.0,
        "max_regret": max((r["regret"] for r in cells), default=0.0),
        "share_pull_faster": sum(r["faster"] == "pull" for r in cells) / n if n else 0.0,
        "share_within_tolerance": sum(r["within_tolerance"] for r in cells) / n if n else 0.0,
    }


def measured_breakeven_bits_per_s(points: Sequence[tuple[float, float, float]]) -> float | None:
    """From (rate, pull_s, recompute_s) over rates: the rate where pull/recompute crosses 1 (log-log interp)."""
    pts = sorted((r, math.log(p / c)) for r, p, c in points if r > 0 and p > 0 and c > 0)
    for (r0, y0), (r1, y1) in zip(pts, pts[1:], strict=False):
        if y0 >= 0 > y1 or y0 > 0 >= y1:
            t = y0 / (y0 - y1)
            return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
    return None


def crossover_prefix(points: Sequence[tuple[int, float, float]]) -> float | None:
    """From (prefix, pull_s, recompute_s): the prefix length where pulling starts to win (log interp)."""
    pts = sorted((float(n), math.log(p / c)) for n, p, c in points if p > 0 and c > 0)
    if pts and pts[0][1] < 0:
        return pts[0][0]  # pull already wins at the shortest prefix
    for (n0, y0), (n1, y1) in zip(pts, pts[1:], strict=False):
        if y0 >= 0 > y1:
            t = y0 / (y0 - y1)
            return math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0)))
    return None


# ---------------------------------------------------------------- the cluster


class BenchCluster(LocalCluster):
    """A `LocalCluster` (no prefill/decode at start) whose stores may live in another network namespace,
    and whose single prefill node is (re)started per link with its own environment."""

    def __init__(self, spec: LocalClusterSpec, *, store_netns: str | None = None, store_host: str | None = None,
                 log_dir: Path | None = None) -> None:  # fmt: skip
        super().__init__(spec, log_dir=log_dir)
        self.store_netns = store_netns
        self.store_host = store_host or spec.host
        self.prefill_proc: RoleProcess | None = None
        self._num_prefill_starts = 0

    def start_store(self, node_id: str, *, wait: bool = True, timeout_s: float = 60.0) -> RoleProcess:
        from kvpool.bench.netns import python_in_netns

        s = self.spec
        ctx = (
            python_in_netns(self.store_netns, str(self.log_dir))
            if self.store_netns
            else contextlib.nullcontext()
        )
        with ctx:
            proc = self._spawn(
                node_id,
                ["store", "--master", self.master_address, "--listen", self.store_host, "--grpc-port", "0",
                 "--data-port", "0", "--segment-size", s.segment_size, "--layout", s.layout, "--node-id", node_id],
            )  # fmt: skip
        if wait:
            proc.wait_ready(timeout_s)
        return proc

    def start_prefill(self, env: dict[str, str], timeout_s: float = 600.0) -> RoleProcess:
        """Stop the current prefill node (if any) and start a fresh one with `env` added."""
        if self.prefill_proc is not None:
            self.prefill_proc.stop()
            self.processes.remove(self.prefill_proc)
        s = self.spec
        self._num_prefill_starts += 1
        node_id = f"prefill{self._num_prefill_starts}"
        args = ["prefill", "--node-id", node_id, "--master", self.master_address, "--listen", s.host, "--port", "0",
                "--device", s.device, "--block-size", str(s.block_size)] + (["--model", s.model_dir] if s.model_dir else [])  # fmt: skip
        proc = RoleProcess(node_id, args, log_path=self.log_dir / f"{node_id}.log",
                           env=dict(os.environ) | s.extra_env | env)  # fmt: skip
        self.processes.append(proc)
        self.prefill_proc = proc
        proc.wait_ready(timeout_s)
        return proc


class PrefillCaller:
    """Prefill-only requests against one node (TTFT = until this caller holds the first token)."""

    def __init__(self, address: str, timeout_s: float = 900.0) -> None:
        from kvpool.rpc.server import channel
        from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

        self._ch = channel(address)
        self._stub = pb_grpc.PrefillStub(self._ch)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self._ch.close()

    def __call__(self, tokens: Sequence[int], *, use_cache: bool, publish: bool, rid: str) -> tuple[float, dict[str, Any]]:  # fmt: skip
        """(TTFT seconds, the node's PrefillStats as a dict); consumes the stream (publish included)."""
        from kvpool.demo.orchestrator import Sampling
        from kvpool.v1 import kvpool_pb2 as pb

        req = pb.PrefillRequest(request_id=rid, token_ids=list(tokens), sampling=Sampling(max_tokens=1).to_proto(),
                                publish=publish, use_cache=use_cache)  # fmt: skip
        t0 = time.perf_counter()
        ttft, stats = 0.0, {}
        for event in self._stub.Prefill(req, timeout=self.timeout_s):
            if event.HasField("first_token"):
                ttft = time.perf_counter() - t0
                st = event.first_token.stats
                stats = {f.name: getattr(st, f.name) for f in st.DESCRIPTOR.fields}
            elif event.HasField("published"):
                stats["publish_status"] = event.published.status
        return ttft, stats


def _wait_recompute_model(cluster: BenchCluster, node_id: str, timeout_s: float = 30.0) -> RecomputeModel:
    from kvpool.client import MasterClient

    deadline = time.monotonic() + timeout_s
    with MasterClient(cluster.master_address) as master:
        while True:
            for node in master.list_nodes():
                if node.node.node_id == node_id and node.load.recompute_s_per_token > 0:
                    return recompute_model_of(node.load)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no recompute figures from {node_id} within {timeout_s} s")
            time.sleep(0.2)


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

    case = ModelCase(name=job.model["name"], spec=EmbeddedSpec(**job.model["spec"]),
                     prefixes=tuple(job.model["prefixes"]), throttled_prefixes=tuple(job.model["throttled_prefixes"]))  # fmt: skip
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
    env = {"KVPOOL_LOCAL_TIER_BYTES": "0", "KVPOOL_PULL_TIMEOUT_S": "900", "KVPOOL_COST_MARGIN": str(job.margin),
           "KVPOOL_FORCE_DECISION": "pull"} | ({"KVPOOL_CACHE_DIR": job.cache_dir} if job.cache_dir else {})  # fmt: skip
    tls = {lk.ucx_tls for lk in links}
    if len(tls) != 1:
        raise ValueError(f"one job, one UCX_TLS: {sorted(tls)}")
    # every node, the store included, is held to the link's transports: a store allowed shared memory
    # could serve a same-host puller through it, around the tcp link (and its throttle)
    env["UCX_TLS"] = tls.pop()
    if "sm" not in env["UCX_TLS"].split(","):  # nor map its segment (same-host reads bypass UCX entirely)
        env["KVPOOL_SHARE_SEGMENT"] = "false"
    spec = LocalClusterSpec(layout=layout.fingerprint(), num_stores=1, num_prefill=0, num_decode=0, block_size=job.block_size,
                            model_dir=model_dir, host=job.host, segment_size=f"{seg // 2**20}MiB", extra_env=env)  # fmt: skip
    records: list[dict[str, Any]] = []
    keep = os.environ.get("KVPOOL_BENCH_LOG_DIR")  # keep the nodes' logs there (debugging)
    log_dir = Path(tempfile.mkdtemp(prefix=f"{case.name}-", dir=keep)) if keep else None
    cluster = BenchCluster(spec, store_netns=pair.addr.ns_b if pair else None, store_host=pair.addr.b if pair else None,
                           log_dir=log_dir)  # fmt: skip
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
                _, st = call(base[: min(prefixes_of[link.name])] + questions[1], use_cache=True, publish=False,
                             rid="check")  # fmt: skip
                if st.get("num_reused_tokens", 0) == 0:
                    log(f"[{case.name}] link {link.name}: the prefix is no longer pullable (a failed connect or "
                        "probe reported the replica bad); its cells will fail")  # fmt: skip
                recompute = _wait_recompute_model(cluster, proc.name)
                log(
                    f"[{case.name}] link {link.name}: prefill up and warm in {time.perf_counter() - t0:.1f} s"
                )
                for prefix in prefixes_of[link.name]:
                    records.append(
                        _measure_cell(call, case, link, prefix, base, questions, job, recompute, token_nbytes)
                    )
                    r = records[-1]
                    log(f"[{case.name}] {link.name:>12} prefix {prefix:>5}: pull {r['pull_ttft_s']:.3f} s, "
                        f"recompute {r['recompute_ttft_s']:.3f} s, choice {r.get('choice', '?')}")  # fmt: skip
            finally:
                call.close()
    return records


def _measure_cell(call: PrefillCaller, case: ModelCase, link: LinkCase, prefix: int, base: list[int],
                  questions: list[list[int]], job: Job, recompute: RecomputeModel, token_nbytes: int) -> dict[str, Any]:  # fmt: skip
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
        "model": case.name, "link": link.name, "link_kind": link.kind,
        "configured_rate_mbit": link.rate_bits_per_s / 1e6 if link.rate_bits_per_s else None,
        "prefix_tokens": prefix, "question_tokens": job.question_tokens, "prompt_tokens": prompt_tokens,
        "kv_bytes": prefix * token_nbytes, "token_nbytes": token_nbytes,
        "pull_ttft_s": statistics.median(pulls), "recompute_ttft_s": statistics.median(recs),
        "pull_samples_s": pulls, "recompute_samples_s": recs,
        "node_pull_s": statistics.median(s["pull_s"] for s in node),
        "node_match_s": statistics.median(s["match_s"] for s in node),
        "predicted_load_s": pred_load, "margin": job.margin,
        "recompute_model": {"overhead_s": recompute.overhead_s, "per_token_s": recompute.per_token_s,
                            "per_pair_s": recompute.per_pair_s},
        "ok": ok,
    }  # fmt: skip
    node_rec_all = statistics.median(s["predicted_recompute_s"] for s in node)
    node_rest = statistics.median(s.get("predicted_compute_s", 0.0) for s in node)
    rec["node_predicted_recompute_s"], rec["node_predicted_compute_s"] = node_rec_all, node_rest
    rec |= predict_cell(recompute, pred_load, prompt_tokens, prefix, job.margin, node_rec_all, node_rest)
    rec |= score_cell(rec["pull_ttft_s"], rec["recompute_ttft_s"], rec["choice"])
    return rec


def _worker_main(job_path: str, out_path: str) -> None:
    job = Job(**json.loads(Path(job_path).read_text()))
    records = run_job(job, log=lambda m: print(m, file=sys.stderr, flush=True))
    Path(out_path).write_text(json.dumps(records))


def run_job_in_netns(job: Job, pair: Any, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run `job` in a child process inside namespace A (its store node goes to namespace B)."""
    from kvpool.cluster.process import die_with_parent

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
            "kvpool.bench.crossover",
            str(jp),
            str(op),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=die_with_parent)  # fmt: skip
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


# ---------------------------------------------------------------- the benchmark


@contextlib.contextmanager
def _maybe_pair(use: bool) -> Iterator[Any]:
    if not use:
        yield None
        return
    from kvpool.bench.netns import ThrottledPair

    with ThrottledPair() as pair:
        yield pair


def run_crossover(
    *,
    quick: bool = False,
    reps: int | None = None,
    rates_mbit: Sequence[float] | None = None,
    question_tokens: int = 32,
    margin: float = DEFAULT_MARGIN,
    netns: bool = True,
    fresh_calibration: bool | None = None,
    models: Sequence[ModelCase] | None = None,
    json_out: Path | None = None,
    plot_out: Path | None = None,
) -> dict[str, Any]:
    """Run the grid (see the module docstring); print tables; write the report and plot. Returns the report."""
    from rich.console import Console

    from kvpool.bench.netns import netns_unavailable_reason
    from kvpool.bench.report import write_report

    console = Console(stderr=True)
    if threading.current_thread() is threading.main_thread():  # SIGTERM unwinds: namespaces are deleted
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    models = tuple(models or (QUICK_MODELS if quick else FULL_MODELS))
    reps = reps or 3
    fresh = (not quick) if fresh_calibration is None else fresh_calibration
    why_not = netns_unavailable_reason() if netns else "disabled (--no-netns)"
    if why_not:
        console.print(f"[yellow]throttled links: {why_not}[/yellow]")
    t_start = time.perf_counter()
    records: list[dict[str, Any]] = []
    notes: dict[str, Any] = {"throttled_links": why_not or "measured", "rates_mbit": {}}
    with contextlib.ExitStack() as stack:
        cache_dir = (
            stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-calib-")) if fresh else None
        )
        for case in models:
            m = {"name": case.name, "spec": asdict(case.spec), "prefixes": list(case.prefixes),
                 "throttled_prefixes": list(case.throttled_prefixes)}  # fmt: skip
            recs = []
            for kind in ("shm", "tcp"):  # one cluster each: the store's transports differ
                job = Job(model=m, links=[asdict(LinkCase(name=kind, kind=kind))], reps=reps,
                          question_tokens=question_tokens, margin=margin, cache_dir=cache_dir)  # fmt: skip
                recs += run_job(job, log=console.log)
            records += recs
            if why_not:
                continue
            rates = [r * 1e6 for r in rates_mbit] if rates_mbit else _auto_rates(recs, question_tokens, quick)
            notes["rates_mbit"][case.name] = [round(r / 1e6, 2) for r in rates]
            console.log(f"[{case.name}] throttled rates (Mb/s): {notes['rates_mbit'][case.name]}")
            tjob = Job(model=m, links=[asdict(tbf_link(r)) for r in rates], reps=reps, question_tokens=question_tokens,
                       margin=margin, cache_dir=cache_dir)  # fmt: skip
            with _maybe_pair(True) as pair:
                records += run_job_in_netns(tjob, pair, console.log)
    summary = summarize(records) | _crossovers(records, question_tokens) | {
        "wall_s": round(time.perf_counter() - t_start, 1), "reps": reps, "tolerance": TOLERANCE, "margin": margin,
        "fresh_calibration": fresh, **notes,
    }  # fmt: skip
    _print_tables(console, records, summary)
    report = write_report(json_out, "crossover", records, summary)
    if plot_out is not None:
        plot_crossover(records, summary, plot_out)
    return report


def _auto_rates(records: Sequence[dict[str, Any]], question_tokens: int, quick: bool) -> list[float]:
    """Multiples of the break-even bandwidth at the grid's middle prefix (from the calibrated model)."""
    rec = sorted(records, key=lambda r: r["prefix_tokens"])[len(records) // 2]
    model = RecomputeModel(**rec["recompute_model"])
    ref = breakeven_bits_per_s(model, rec["prefix_tokens"], question_tokens, rec["token_nbytes"])
    mults = (0.5, 2.0) if quick else RATE_MULTIPLIERS
    rates = sorted({max(MIN_RATE_BITS, ref * m) for m in mults})
    return rates if quick else rates + [FAST_RATE_BITS]


def _crossovers(records: Sequence[dict[str, Any]], question_tokens: int) -> dict[str, Any]:
    """Crossover prefix per (model, link), break-even bandwidth per (model, prefix): measured vs predicted,
    and each link's bandwidth as the cost model learned it (fit of predicted load vs bytes)."""
    from kvpool.cost import LinkEstimate

    cells = [r for r in records if r.get("ok")]
    by_link: dict[str, dict[str, Any]] = {}
    for model, link in sorted({(r["model"], r["link"]) for r in cells}):
        rs = sorted(
            (r for r in cells if r["model"] == model and r["link"] == link), key=lambda r: r["prefix_tokens"]
        )
        entry: dict[str, Any] = {
            "measured_crossover_prefix": crossover_prefix([(r["prefix_tokens"], r["pull_ttft_s"], r["recompute_ttft_s"]) for r in rs]),
            "predicted_crossover_prefix": crossover_prefix([(r["prefix_tokens"], r["predicted_pull_ttft_s"], r["predicted_recompute_ttft_s"]) for r in rs]),
            "configured_rate_mbit": rs[0]["configured_rate_mbit"],
        }  # fmt: skip
        try:
            est = LinkEstimate.from_samples([(r["kv_bytes"], r["predicted_load_s"]) for r in rs])
            entry |= {
                "learned_beta_mbit": round(est.beta_bytes_per_s * 8 / 1e6, 2),
                "learned_alpha_ms": round(est.alpha_s * 1e3, 3),
            }
        except Exception:  # noqa: BLE001 - fewer than two sizes
            entry |= {"learned_beta_mbit": round(8 * rs[-1]["kv_bytes"] / rs[-1]["predicted_load_s"] / 1e6, 2) if rs[-1]["predicted_load_s"] > 0 else None}  # fmt: skip
        by_link[f"{model}/{link}"] = entry
    by_prefix: dict[str, dict[str, Any]] = {}
    for model, prefix in sorted({(r["model"], r["prefix_tokens"]) for r in cells if r["link_kind"] == "tbf"}):
        rs = [
            r
            for r in cells
            if r["model"] == model and r["prefix_tokens"] == prefix and r["link_kind"] == "tbf"
        ]
        meas = measured_breakeven_bits_per_s(
            [(r["configured_rate_mbit"] * 1e6, r["pull_ttft_s"], r["recompute_ttft_s"]) for r in rs]
        )
        alphas = [by_link[f"{model}/{r['link']}"].get("learned_alpha_ms") or 0.0 for r in rs]
        pred = breakeven_bits_per_s(RecomputeModel(**rs[0]["recompute_model"]), prefix, question_tokens, rs[0]["token_nbytes"],
                                    statistics.median(alphas) / 1e3)  # fmt: skip
        by_prefix[f"{model}/{prefix}"] = {
            "measured_breakeven_mbit": round(meas / 1e6, 2) if meas else None,
            "predicted_breakeven_mbit": round(pred / 1e6, 2) if math.isfinite(pred) else None,
        }
    return {"links": by_link, "breakeven": by_prefix}


def _print_tables(console: Any, records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.table import Table

    for model in sorted({r["model"] for r in records}):
        rs = [r for r in records if r["model"] == model]
        prefixes = sorted({r["prefix_tokens"] for r in rs})
        table = Table(
            title=f"crossover, {model}: TTFT pulled / recomputed (s), auto's choice (P/R), ✗ = wrong"
        )
        table.add_column("link")
        table.add_column("learned β Mb/s", justify="right")
        for p in prefixes:
            table.add_column(f"{p} tok", justify="right")
        links = sorted(
            {r["link"] for r in rs},
            key=lambda n: next(r["configured_rate_mbit"] or 1e9 + ord(n[0]) for r in rs if r["link"] == n),
        )
        for link in links:
            row = [link, str(summary["links"].get(f"{model}/{link}", {}).get("learned_beta_mbit", "-"))]
            for p in prefixes:
                c = next((r for r in rs if r["link"] == link and r["prefix_tokens"] == p), None)
                if c is None:
                    row.append("")
                elif not c["ok"]:
                    row.append("failed")
                else:
                    mark = c["choice"][0].upper() + ("" if c["right"] else " ✗")
                    row.append(f"{c['pull_ttft_s']:.3f}/{c['recompute_ttft_s']:.3f} {mark}")
            table.add_row(*row)
        console.print(table)
    console.print(
        f"decision_accuracy {summary['decision_accuracy']:.3f} (target >= 0.95), mean_regret "
        f"{summary['mean_regret']:.3f} (target <= 0.05) over {summary['num_cells']} cells; pull faster in "
        f"{summary['share_pull_faster']:.0%}; wall {summary['wall_s']} s"
    )


def plot_crossover(records: Sequence[dict[str, Any]], summary: dict[str, Any], out: Path) -> None:
    """One panel per (model, link): measured TTFT pulled (solid) and recomputed (dashed) vs prefix length,
    the predictions (dotted) and the predicted crossover prefix (vertical line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model"], r["link"], r["configured_rate_mbit"] or math.inf, r["link_kind"]) for r in records},
                  key=lambda k: (k[0], k[3] == "tbf", k[2]))  # fmt: skip
    ncols = 5
    nrows = max(1, math.ceil(len(keys) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.0 * nrows), squeeze=False, sharex=True)
    for ax in axes.flat[len(keys) :]:
        ax.axis("off")
    for ax, (model, link, _, _) in zip(axes.flat, keys, strict=False):
        rs = sorted((r for r in records if r["model"] == model and r["link"] == link and r.get("ok")),
                    key=lambda r: r["prefix_tokens"])  # fmt: skip
        x = [r["prefix_tokens"] for r in rs]
        ax.plot(x, [r["pull_ttft_s"] for r in rs], "o-", color="tab:blue", label="pulled")
        ax.plot(x, [r["recompute_ttft_s"] for r in rs], "s--", color="tab:red", label="recomputed")
        ax.plot(
            x, [r["predicted_pull_ttft_s"] for r in rs], ":", color="tab:blue", alpha=0.7, label="pred. pull"
        )
        ax.plot(
            x,
            [r["predicted_recompute_ttft_s"] for r in rs],
            ":",
            color="tab:red",
            alpha=0.7,
            label="pred. recompute",
        )
        for r in rs:
            if not r["right"]:
                ax.plot([r["prefix_tokens"]], [r[f"{r['choice']}_ttft_s"]], "x", color="black", ms=10)
        cx = summary.get("links", {}).get(f"{model}/{link}", {}).get("predicted_crossover_prefix")
        if cx:
            ax.axvline(cx, color="gray", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model}\n{link}", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(
        f"TTFT pulled vs recomputed (x = wrong auto choice; gray line = predicted crossover); accuracy "
        f"{summary.get('decision_accuracy', 0):.2f}, mean regret {summary.get('mean_regret', 0):.3f}",
        fontsize=10,
    )
    fig.supxlabel("shared prefix (tokens)")
    fig.supylabel("TTFT (s)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # the namespace worker: python -m kvpool.bench.crossover JOB.json OUT.json
    _worker_main(sys.argv[1], sys.argv[2])
