"""`kvpool up` serves its gRPC with mutual TLS (slow: a real cluster of real processes).

A cluster from a spec serves a request through the router (the router's and the nodes' gRPC clients
under TLS); the admin CLI works with the export line `kvpool up` printed and fails without it; a plaintext
health check of the master gets no answer; the generated key is 0600 while the cluster runs and gone after.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.slow

MODEL = "kvpool-tiny-llama-l4-h256-a8-kv4-i688"
SPEC = """
[cluster]
block_size = 16
[master]
port = 0
[store]
count = 1
segment_size = "64MiB"
[router]
port = 0
"""
TLS_VARS = ("KVPOOL_TLS_CA_FILE", "KVPOOL_TLS_CERT_FILE", "KVPOOL_TLS_KEY_FILE", "KVPOOL_TLS_CLIENT_AUTH")


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in TLS_VARS} | {"PYTHONUNBUFFERED": "1"} | extra


def _wait(lines: list[str], proc: subprocess.Popen[str], text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in x for x in list(lines)):
        assert proc.poll() is None, "kvpool up exited:\n" + "".join(lines[-40:])
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s} s:\n" + "".join(lines[-40:])
        time.sleep(0.1)


def _address(lines: list[str], role: str) -> str:
    for x in lines:
        words = x.split()
        if x.startswith("  ") and len(words) >= 2 and words[0] == role:
            return words[1].removeprefix("http://").removesuffix("/v1")
    raise AssertionError(f"no {role} endpoint in:\n" + "".join(lines))


def _admin(master: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "admin", "--master", master, "nodes"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_up_runs_mutual_tls_and_the_admin_cli_uses_its_export_line(tmp_path: Path) -> None:
    import httpx

    spec = tmp_path / "cluster.toml"
    spec.write_text(SPEC)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec), "--insecure"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
    )  # fmt: skip
    lines: list[str] = []
    assert proc.stdout is not None
    pipe = proc.stdout
    threading.Thread(target=lambda: lines.extend(iter(pipe.readline, "")), daemon=True).start()
    try:
        _wait(lines, proc, "Ctrl-C stops everything", 240)
        master, router = _address(lines, "master"), _address(lines, "router")
        line = next(x for x in lines if "gRPC TLS (mutual)" in x)
        exported = dict(re.findall(r"(KVPOOL_TLS_\w+)=(\S+)", line))
        assert set(exported) == set(TLS_VARS), line
        key = Path(exported["KVPOOL_TLS_KEY_FILE"])
        assert key.stat().st_mode & 0o777 == 0o600

        r = httpx.post(f"http://{router}/v1/completions",
                       json={"model": MODEL, "prompt": "tls " * 40, "max_tokens": 2}, timeout=120)  # fmt: skip
        assert r.status_code == 200, r.text  # router -> master, prefill, decode over TLS

        ok = _admin(master, _env(**exported))
        assert ok.returncode == 0, ok.stderr
        assert "store0" in ok.stdout and "prefill0" in ok.stdout
        plain = _admin(master, _env())
        assert plain.returncode != 0 and master in plain.stderr

        with grpc.insecure_channel(master) as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, "".join(lines[-40:])
    assert not key.exists()  # the key does not outlive the cluster
