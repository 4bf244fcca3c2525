"""A serving node asks the master what it would refuse before it loads its model, and waits for a master
that is not up yet for a bounded time (`master_wait_s`): real `kvpool prefill`/`decode` processes against
a real master (and store) on ephemeral ports. "Before it loads its model" is checked by its log: the node
logs `model ...: SYNTHETIC weights` once the embedded model is loaded, and a refused node never does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.capability import new_secret_env
from kvpool.client import MasterClient
from kvpool.client.master_wait import wait_for_master
from kvpool.errors import Unavailable
from kvpool.master.procs import LAYOUT, start, start_master, start_store
from kvpool.membership import new_cluster_tokens
from kvpool.model.runner import model_layout
from kvpool.types import DEFAULT_LAYOUT

_LOADED = "SYNTHETIC weights"  # logged once the node's (embedded) model is loaded


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", *args, "--port", "0", "--no-metrics"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip
    return out, time.monotonic() - t0


def _last_line(out: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if " INFO " not in ln and " WARNING " not in ln]
    assert len(errors) == 1, out.stderr
    return errors[0]


def test_a_block_size_the_master_refuses_is_named_before_the_model_loads() -> None:
    """A master whose pool has another block size (no member yet: `Stats.block_size` tells)."""
    assert model_layout(None).fingerprint() == DEFAULT_LAYOUT  # read from config.json, no weights loaded
    assert model_layout(None, block_size=32).fingerprint() == DEFAULT_LAYOUT.replace(":b64:", ":b32:")
    master = start_master(layout=DEFAULT_LAYOUT.replace(":b64:", ":b32:"))
    try:
        out, _ = _node("prefill", "--master", master.grpc_address)
    finally:
        master.kill()
    assert out.returncode == 1 and _LOADED not in out.stderr, out.stderr
    assert _last_line(out) == (
        "kvpool prefill: FailedPrecondition: the master refuses this node: its pool's block size is 32 tokens, "
        f"this node's is 64 (layout '{DEFAULT_LAYOUT}'); start it with --block-size 32, or the master with "
        "this node's layout (`kvpool layout`)"
    )


def test_a_layout_other_than_the_live_members_is_named_before_the_model_loads() -> None:
    """Same block size, another layout: the pool's fingerprint comes from its live store's `GetInfo`."""
    assert LAYOUT != DEFAULT_LAYOUT and LAYOUT.split(":")[2] == DEFAULT_LAYOUT.split(":")[2]
    master = start_master(layout=LAYOUT)
    store = start_store(master.grpc_address, "store0", layout=LAYOUT)
    try:
        out, _ = _node("decode", "--master", master.grpc_address)
    finally:
        store.kill()
        master.kill()
    assert out.returncode == 1 and _LOADED not in out.stderr, out.stderr
    assert _last_line(out) == (
        f"kvpool decode: FailedPrecondition: the master refuses this node: layout '{DEFAULT_LAYOUT}' does not "
        f"match the pool's '{LAYOUT}' (`kvpool layout --model DIR` prints a model's layout)"
    )


def test_a_join_token_the_master_refuses_is_named_before_the_model_loads(tmp_path: Path) -> None:
    _token, master_env, _member_env = new_cluster_tokens(tmp_path)
    master_env |= new_secret_env(tmp_path)  # secured: with the cluster secret
    master = start(["master", "--port", "0", "--layout", DEFAULT_LAYOUT], env=master_env)
    try:
        out, _ = _node("prefill", "--master", master.grpc_address, env={"KVPOOL_JOIN_TOKEN": "x" * 40})
    finally:
        master.kill()
    assert out.returncode == 2 and _LOADED not in out.stderr, out.stderr
    assert _last_line(out).startswith("kvpool prefill: Unauthenticated: "), out.stderr


def test_an_unreachable_master_is_retried_for_master_wait_s_then_one_line() -> None:
    port = _free_port()  # nothing listens there
    out, elapsed_s = _node("decode", "--master", f"127.0.0.1:{port}", "--master-wait-s", "2")
    assert out.returncode == 1 and _LOADED not in out.stderr, out.stderr
    line = _last_line(out)
    assert line.startswith(f"kvpool decode: Unavailable: master 127.0.0.1:{port} unreachable for 2 s ("), line
    assert "master_wait_s = 2)" in line
    assert 2.0 <= elapsed_s < 60, elapsed_s  # the start (imports) included; not the 30 s default
    assert out.stderr.count("unreachable (attempt 1)") == 1


def test_retry_lines_are_rate_limited_and_the_wait_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """`wait_for_master` on a real unreachable address, on an injected clock: back-off 0.25 s doubling to
    2 s, one line per 5 s at most, `Unavailable` once `wait_s` passed."""
    now = [0.0]
    pauses: list[float] = []

    def sleep(s: float) -> None:
        pauses.append(s)
        now[0] += s

    caplog.set_level("WARNING", logger="kvpool.serving.preflight")
    bounded = pytest.raises(Unavailable, match=r"unreachable for 12 s \(10 attempts; master_wait_s = 12\)")
    with MasterClient(f"127.0.0.1:{_free_port()}", timeout_s=1.0) as master, bounded:
        wait_for_master(master, 12.0, clock=lambda: now[0], sleep=sleep)
    assert pauses == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.25]  # the last one ends at the deadline
    said = [r.getMessage() for r in caplog.records]
    assert [s.split("(attempt ")[1].split(")")[0] for s in said] == ["1", "6", "9"]  # at 0, 5.75 and 11.75 s


def test_a_node_started_before_its_master_comes_up_once_the_master_does() -> None:
    port = _free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "prefill", "--master", f"127.0.0.1:{port}", "--port", "0",
         "--no-metrics", "--master-wait-s", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    master = None
    try:
        assert node.stderr is not None and node.stdout is not None
        for line in node.stderr:  # it is waiting for the master
            if "unreachable (attempt 1)" in line:
                break
        time.sleep(1.0)
        master = start_master(port=port, layout=DEFAULT_LAYOUT)
        ready = node.stdout.readline()
        assert ready.startswith("KVPOOL_READY "), ready
    finally:
        node.kill()
        node.wait()
        if master is not None:
            master.kill()
