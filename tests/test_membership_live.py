"""Membership with serving processes (issue #24): a serving node whose join token is revoked is refused at
its next heartbeat (stores, which hold no token, keep serving); a secured `kvpool up` cluster and an
`--insecure` one both answer through the router."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvpool.cluster.process import wait_for
from kvpool.membership import add_token, revoke_token
from kvpool.types import DEFAULT_LAYOUT
from tests.capabilities import require_ucx


def _require_ucx() -> None:
    require_ucx()


def _alive(master: str) -> dict[str, bool]:
    from kvpool.client import MasterClient

    with MasterClient(master) as mc:
        return {n.node.node_id: n.alive for n in mc.list_nodes()}


@pytest.mark.slow
def _without_operator_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "KVPOOL_JOIN_TOKEN"}


@pytest.mark.slow
def test_a_serving_node_with_a_revoked_token_is_refused_at_its_next_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _require_ucx()
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec

    spec = LocalClusterSpec(
        layout=DEFAULT_LAYOUT, num_stores=1, num_prefill=1, num_decode=0, segment_size="16MiB"
    )
    with LocalCluster(spec) as cluster:
        tokens = cluster.log_dir / "join_tokens.json"
        monkeypatch.setenv("KVPOOL_JOIN_TOKEN", add_token(tokens, "operator"))  # a token of its own
        time.sleep(0.6)  # the master re-reads the file within TOKEN_RELOAD_INTERVAL_S
        assert _alive(cluster.master_address) == {"store0": True, "prefill0": True}
        assert revoke_token(tokens, "cluster")  # the token the prefill node joined with
        prefill = cluster.prefill[0]
        assert wait_for(lambda: not prefill.alive, timeout_s=30), prefill.log_tail()
        log = prefill.log_path.read_text()
        assert "join token 'cluster' was revoked" in log, log[-3000:]
        assert _alive(cluster.master_address) == {"store0": True, "prefill0": False}
        restarted = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "prefill", "--master", cluster.master_address,
             "--listen", "127.0.0.1", "--port", "0", "--node-id", "prefill9"],
            capture_output=True, text=True, timeout=120, env=_without_operator_token() | cluster.member_env,
        )  # fmt: skip
        assert restarted.returncode == 2, restarted.stderr[-2000:]
        assert "unknown or revoked join token" in restarted.stderr and "Traceback" not in restarted.stderr


def _up(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], str, list[str]]:
    spec = tmp_path / "cluster.toml"
    spec.write_text(
        '[cluster]\nblock_size = 64\n[master]\nport = 0\n[store]\ncount = 1\nsegment_size = "32MiB"\n'
        "[prefill]\ncount = 1\n[decode]\ncount = 1\n[router]\nport = 0\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec), "--quiet", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    router = ""
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"router\s+(http://\S+)/v1", line)
        router = m.group(1) if m else router
        if line.startswith("logs in") and router:
            return proc, router, lines
    proc.kill()
    raise AssertionError("kvpool up did not print its router:\n" + "".join(lines))


@pytest.mark.slow
@pytest.mark.parametrize("secured", [True, False], ids=["secured", "insecure"])
def test_kvpool_up_serves_secured_and_insecure(tmp_path: Path, secured: bool) -> None:
    _require_ucx()
    proc, router, lines = _up(tmp_path, *(() if secured else ("--insecure",)))
    try:
        model = httpx.get(f"{router}/v1/models", timeout=30).json()["data"][0]["id"]
        body = {"model": model, "prompt": "the same system prompt " * 8, "max_tokens": 2, "temperature": 0}
        first = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
        second = httpx.post(f"{router}/v1/completions", json=body, timeout=120)
        assert first.status_code == second.status_code == 200, first.text
        assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
        text = "".join(lines)
        if secured:
            assert "secured:" in text and "KVPOOL_JOIN_TOKEN_FILE=" in text, text
        else:
            assert "UNSECURED CLUSTER" in text, text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0
