"""Start `kvpool master` / `kvpool store` as child processes and wait for their `KVPOOL_READY` line.

For tests, benchmarks and local clusters. The caller owns each `Proc` and calls `kill()` (in `finally`).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from kvpool.rpc.process import die_with_parent

LAYOUT = "kv1:float32:b64:l4:h2:d32"


@dataclass
class Proc:
    popen: subprocess.Popen[str]
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def grpc_address(self) -> str:
        return str(self.ready["grpc_address"])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the child (SIGKILL by default: a crash) and reap it."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def _kvpool() -> list[str]:
    return [sys.executable, "-m", "kvpool.cli.main"]


def start(args: list[str], timeout_s: float = 60.0, env: dict[str, str] | None = None) -> Proc:
    """Run `kvpool ARGS`, wait for `KVPOOL_READY {json}` on stdout; raise `RuntimeError` otherwise."""
    popen = subprocess.Popen(
        die_with_parent([*_kvpool(), *args]),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if not os.environ.get("KVPOOL_TEST_LOGS") else None,
        text=True,
        env={**os.environ, **(env or {})},
    )
    proc = Proc(popen)
    deadline = time.monotonic() + timeout_s
    assert popen.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([popen.stdout], [], [], 0.2)
        if ready:
            line = popen.stdout.readline()
            if line.startswith("KVPOOL_READY "):
                proc.ready = json.loads(line.split(" ", 1)[1])
                return proc
            if not line and popen.poll() is not None:
                break
        elif popen.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"`kvpool {' '.join(args)}` did not become ready (exit {popen.returncode})")


def start_master(*extra: str, port: int = 0, layout: str = LAYOUT) -> Proc:
    return start(["master", "--port", str(port), "--layout", layout, *extra])


def start_store(
    master: str, node_id: str, *, segment: str = "16MiB", layout: str = LAYOUT, extra: tuple[str, ...] = ()
) -> Proc:
    """`kvpool store` registering with `master`; `extra`: more CLI flags (e.g. `--metrics-port 0`)."""
    return start(
        [
            "store",
            "--master",
            master,
            "--listen",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--data-port",
            "0",
            "--segment-size",
            segment,
            "--layout",
            layout,
            "--node-id",
            node_id,
            "--pin-memory",
            "off",
            *extra,
        ]
    )
