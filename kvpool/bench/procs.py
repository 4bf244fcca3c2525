"""Helpers the benchmarks' parent and child processes share: a child started until it says it is ready,
a free local port, GB/s, and the STEP/RESULT lines a worker prints for its parent."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpool.cluster.local import LocalClusterSpec
    from kvpool.types import KVLayout

KIB, MIB = 1 << 10, 1 << 20


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A child process whose stdout is read until a line starting with `ready` (its rest is `info`)."""

    def __init__(self, args: Sequence[str], ready: str, env: dict[str, str], timeout_s: float = 60.0) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="kvpool-bench-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.proc.stdout.readline()
            if line.startswith(ready):
                self.info = line[len(ready) :].strip()
                return
            if not line or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{args[:4]} did not start: {self.stderr()}")

    def stderr(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


def emit(kind: str, payload: Any) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def run_worker(
    args: Sequence[str], env: dict[str, str], on_step: Callable[[], None], log: list[str] | None = None
) -> Any:
    """Run a worker, calling `on_step` per STEP line; returns its RESULT payload (other lines into `log`)."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        assert proc.stdout is not None
        result = None
        for line in proc.stdout:
            if line.startswith("STEP "):
                on_step()
            elif line.startswith("RESULT "):
                result = json.loads(line[7:])
            elif log is not None:  # UCX logs to stdout
                log.append(line)
        proc.wait()
        err.seek(0)
        if proc.returncode != 0 or result is None:
            raise RuntimeError(
                f"worker failed ({proc.returncode}): {err.read().decode(errors='replace')[-2000:]}"
            )
        return result


def pool_only_spec(
    layout: KVLayout,
    *,
    block_size: int,
    model_dir: str | None,
    segment_bytes: int,
    env: dict[str, str],
    host: str = "127.0.0.1",
) -> LocalClusterSpec:
    """A master and one store node (a segment of `segment_bytes`, rounded down to MiB), no serving node:
    the benchmark's own process is the node. `env` goes to every process of the cluster."""
    from kvpool.cluster.local import LocalClusterSpec

    return LocalClusterSpec(
        layout=layout.fingerprint(),
        num_stores=1,
        num_prefill=0,
        num_decode=0,
        block_size=block_size,
        model_dir=model_dir,
        host=host,
        segment_size=f"{segment_bytes // 2**20}MiB",
        extra_env=env,
    )
