"""The crossover benchmark's cluster (`BenchCluster`: its store may sit in another network namespace, its
prefill node restarts per link), the prefill-only TTFT caller (`PrefillCaller`), and the wait for a node's
calibrated recompute figures (`wait_recompute_model`)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.cluster.process import RoleProcess
from kvpool.cost import RecomputeModel


class BenchCluster(LocalCluster):
    """A `LocalCluster` (no prefill/decode at start) whose stores may live in another network namespace,
    and whose single prefill node is (re)started per link with its own environment."""

    def __init__(
        self,
        spec: LocalClusterSpec,
        *,
        store_netns: str | None = None,
        store_host: str | None = None,
        log_dir: Path | None = None,
    ) -> None:
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
                [
                    "store",
                    "--master",
                    self.master_address,
                    "--listen",
                    self.store_host,
                    "--grpc-port",
                    "0",
                    "--data-port",
                    "0",
                    "--segment-size",
                    s.segment_size,
                    "--layout",
                    s.layout,
                    "--node-id",
                    node_id,
                ],
            )
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
        args = [
            "prefill",
            "--node-id",
            node_id,
            "--master",
            self.master_address,
            "--listen",
            s.host,
            "--port",
            "0",
            "--device",
            s.device,
            "--block-size",
            str(s.block_size),
        ] + (["--model", s.model_dir] if s.model_dir else [])
        proc = RoleProcess(
            node_id, args, log_path=self.log_dir / f"{node_id}.log", env=dict(os.environ) | s.extra_env | env
        )
        self.processes.append(proc)
        self.prefill_proc = proc
        proc.wait_ready(timeout_s)
        return proc


class PrefillCaller:
    """Prefill-only requests against one node (TTFT = until this caller holds the first token)."""

    def __init__(self, address: str, timeout_s: float = 900.0) -> None:
        from kvpool.client.node_client import NodeClient

        self.address = address
        self._nodes = NodeClient(timeout_s=timeout_s)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self._nodes.close()

    def __call__(
        self, tokens: Sequence[int], *, use_cache: bool, publish: bool, rid: str
    ) -> tuple[float, dict[str, Any]]:
        """(TTFT seconds, the node's PrefillStats as a dict); consumes the stream (publish included)."""
        import dataclasses

        from kvpool.client.node_types import FirstToken, PrefillRequest
        from kvpool.sampling import SamplingParams

        req = PrefillRequest(
            request_id=rid,
            token_ids=list(tokens),
            sampling=SamplingParams(max_tokens=1),
            publish=publish,
            use_cache=use_cache,
        )
        t0 = time.perf_counter()
        ttft, stats = 0.0, {}
        for event in self._nodes.prefill(self.address, req):
            if isinstance(event, FirstToken):
                ttft = time.perf_counter() - t0
                stats = dataclasses.asdict(event.stats)
            else:
                stats["publish_status"] = event.status
        return ttft, stats


def wait_recompute_model(cluster: BenchCluster, node_id: str, timeout_s: float = 30.0) -> RecomputeModel:
    from kvpool.client import MasterClient

    deadline = time.monotonic() + timeout_s
    with MasterClient(cluster.master_address) as master:
        while True:
            for node in master.list_nodes():
                if node.node.node_id != node_id:
                    continue
                ld = node.load
                model = RecomputeModel.from_heartbeat(
                    ld.recompute_overhead_s, ld.recompute_s_per_token, ld.recompute_s_per_token_ctx
                )
                if model is not None:
                    return model
            if time.monotonic() > deadline:
                raise RuntimeError(f"no recompute figures from {node_id} within {timeout_s} s")
            time.sleep(0.2)
