"""Shared pieces of the fault suite: the workload, the router in front of a local cluster, answer checks.

Requests go through the real router (OpenAI HTTP); token-id prompts in, generated token ids back
(`return_token_ids`, vLLM's extension), compared with an in-process cold reference of the same model.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.cluster.process import RoleProcess

BLOCK = 16
DOC_BLOCKS = 6


def workload(num: int, *, seed: int = 42, num_docs: int = 10, vocab: int = 256) -> list[list[int]]:
    """`num_docs` shared documents of `DOC_BLOCKS` blocks, each followed by a distinct short question."""
    rng = np.random.default_rng(seed)
    docs = [[int(t) for t in rng.integers(3, vocab, size=DOC_BLOCKS * BLOCK)] for _ in range(num_docs)]
    return [docs[i % num_docs] + [int(t) for t in rng.integers(3, vocab, size=5 + i % 7)] for i in range(num)]


def fault_cluster_spec(runner: Any, *, heartbeat_timeout_ms: int, num_replicas: int = 2) -> LocalClusterSpec:
    """master + 2 stores + prefill + decode for the fault suite. Every hit is a pull from the
    stores (no node-local tier), and pulls are forced: the faults live on the pull path, which the cost
    model may (rightly) skip for 96-token prefixes on a busy host."""
    return LocalClusterSpec(
        layout=runner.layout.fingerprint(), block_size=BLOCK, segment_size="64MiB", num_replicas=num_replicas,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        extra_env={"KVPOOL_LOCAL_TIER_BYTES": "0", "KVPOOL_FORCE_DECISION": "pull"},
    )  # fmt: skip


def start_router(cluster: LocalCluster, name: str = "router") -> str:
    """Start a router process on the cluster (stopped with it); returns its base URL."""
    proc = RoleProcess(
        name,
        ["router", "--master", cluster.master_address, "--port", "0"],
        log_path=cluster.log_dir / f"{name}.log",
    )
    cluster.processes.append(proc)
    proc.wait_ready(90)
    return f"http://{proc.info['http_address']}"


@dataclass
class Tally:
    """Per-phase outcome: requests, failed (error or no answer), wrong (tokens differ), hits."""

    name: str
    requests: int = 0
    failed: int = 0
    wrong: int = 0
    hits: int = 0
    recovery_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def row(self) -> str:
        return f"{self.name:34s} {self.requests:8d} {self.failed:6d} {self.wrong:5d} {self.hits:4d} {self.recovery_s:10.2f}"


class Api:
    """A minimal OpenAI completions client (httpx) that returns generated token ids and cached tokens."""

    def __init__(self, base_url: str, *, max_tokens: int = 3, timeout_s: float = 120.0) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]
        self.max_tokens = max_tokens

    def complete(self, prompt: Sequence[int]) -> tuple[list[int], int]:
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": self.max_tokens, "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        r = self.http.post("/v1/completions", json=body)
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        cached = int(((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return [int(t) for t in data["choices"][0]["token_ids"]], cached

    def serve(
        self, tally: Tally, prompts: Sequence[list[int]], refs: Sequence[list[int]], eos: int | None
    ) -> Tally:
        for prompt, ref in zip(prompts, refs, strict=True):
            tally.requests += 1
            try:
                ids, cached = self.complete(prompt)
            except Exception as exc:  # noqa: BLE001 - counted; the suite asserts none
                tally.failed += 1
                body = getattr(getattr(exc, "response", None), "text", "")  # the router's error message
                tally.notes.append(f"{type(exc).__name__}: {exc} {body[:300]}")
                continue
            tally.wrong += [t for t in ids if t != eos] != [t for t in ref if t != eos]
            tally.hits += cached > 0
        return tally

    def close(self) -> None:
        self.http.close()


def references(runner: Any, prompts: Sequence[list[int]], max_tokens: int = 3) -> list[list[int]]:
    """Cold greedy outputs of the same model in this process (no cache anywhere)."""
    from kvpool.model import SamplingParams

    return [runner.generate(p, params=SamplingParams(max_tokens=max_tokens)) for p in prompts]


_SEGMENT_RE = re.compile(r"segment: (\d+) slots x (\d+) B .* at (0x[0-9a-f]+)")


def segment_of(proc: RoleProcess, timeout_s: float = 10.0) -> tuple[int, int]:
    """(base address, block_nbytes) of a store process's segment, from its start-up log line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = _SEGMENT_RE.search(Path(proc.log_path).read_text(errors="replace"))
        if m:
            return int(m.group(3), 16), int(m.group(2))
        time.sleep(0.1)
    raise AssertionError(f"no segment line in {proc.log_path}")


def corrupt(proc: RoleProcess, slot: int, nbytes: int = 64, seed: int = 0) -> None:
    """Overwrite the first `nbytes` of `slot` in a live store process's memory (a RAM fault, via
    /proc/<pid>/mem; root or ptrace rights over the child)."""
    base, block_nbytes = segment_of(proc)
    garbage = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    with open(f"/proc/{proc.proc.pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(base + slot * block_nbytes)
        mem.write(garbage)
