"""A router started while its master is down: without `--block-size` it waits for the master (as the
serving nodes do, `--master-wait-s`), comes up once it answers, and past the wait says so in one line
(exit 1, naming the way out); with `--block-size` it starts at once and answers 503 until the master is
back. Real `kvpool router` and master processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from kvpool.rpc.process import READY_PREFIX


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _router(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvpool.cli.main", "router", "--port", "0", *args]


def test_without_block_size_a_master_down_past_the_wait_is_one_line_naming_block_size() -> None:
    master = f"127.0.0.1:{_free_port()}"
    out = subprocess.run(
        _router("--master", master, "--master-wait-s", "1"), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if " WARNING " not in ln and " INFO " not in ln]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"kvpool router: Unavailable: master {master} unreachable for "), lines
    assert "master_wait_s = 1" in lines[0] and "give --block-size to start without it" in lines[0], lines


def test_a_router_started_before_its_master_comes_up_once_the_master_does() -> None:
    from kvpool.master.procs import start_master
    from kvpool.types import DEFAULT_LAYOUT

    port = _free_port()
    router = subprocess.Popen(
        _router("--master", f"127.0.0.1:{port}", "--master-wait-s", "60"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    master = None
    try:
        assert router.stderr is not None and router.stdout is not None
        for line in router.stderr:  # it is waiting for the master
            if "unreachable (attempt 1)" in line:
                break
        else:
            raise AssertionError(f"the router did not wait: exit {router.wait(timeout=30)}")
        time.sleep(1.0)
        master = start_master(port=port, layout=DEFAULT_LAYOUT)
        ready = router.stdout.readline()
        assert ready.startswith(READY_PREFIX), ready
    finally:
        os.killpg(router.pid, signal.SIGTERM)
        router.wait(timeout=30)
        if master is not None:
            master.kill()


def test_with_block_size_it_starts_and_answers_503_while_the_master_is_down() -> None:
    master = f"127.0.0.1:{_free_port()}"
    proc = subprocess.Popen(
        _router("--master", master, "--block-size", "64"),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        ready = ""
        while time.monotonic() < deadline and not ready:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith(READY_PREFIX):
                ready = line[len(READY_PREFIX) :]
        assert ready, f"no READY line; exit {proc.poll()}"
        url = f"http://{json.loads(ready)['http_address']}/health"
        try:
            urllib.request.urlopen(url, timeout=10)
            raise AssertionError("/health answered 200 with the master down")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
            body = json.loads(exc.read())
        assert body["status"] == "unavailable" and master in body["error"], body
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0  # SIGTERM is a clean stop (uvicorn re-raises it after shutting down)
