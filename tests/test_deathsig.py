"""Children die with their launcher (`kvpool.rpc.deathsig`), and launching never forks through Python.

A launcher kill -9'd leaves no orphan: its child gets SIGTERM (Linux `PR_SET_PDEATHSIG`, armed after the
fork and kept across exec). A child whose launcher is already gone does not start. Launching from a
threaded process that is busy with gRPC (what `kvpool up` does between health checks and restarts) never
hangs: no `preexec_fn`, so `subprocess` takes its vfork path and runs no fork handler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvpool.rpc.process import die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _program(pid: int) -> bytes:
    """The program a process runs now (argv[0]); b"" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return b""


def _wait_exec(pid: int, program: bytes) -> None:
    """Until the wrapper has exec'd `program` (the signal is armed by then)."""
    deadline = time.monotonic() + 10
    while _program(pid) != program and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _program(pid) == program


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too (reaped by init later)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_killed_launcher_leaves_no_orphan(tmp_path: Path) -> None:
    launcher = textwrap.dedent(
        """
        import subprocess, sys, time
        from kvpool.rpc.process import die_with_parent
        child = subprocess.Popen(die_with_parent(["sleep", "120"]))
        print(child.pid, flush=True)
        time.sleep(120)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    child_pid = int(proc.stdout.readline())
    _wait_exec(child_pid, b"sleep")
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid), "the child outlived its kill -9'd launcher"


def test_a_child_whose_launcher_is_gone_does_not_start(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    argv = die_with_parent(["touch", str(marker)])
    argv[argv.index("--") - 1] = "1"  # a parent pid that is not this child's parent
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert not marker.exists()


def test_bad_usage_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "kvpool.rpc.deathsig", "x"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.startswith("usage: python -m kvpool.rpc.deathsig")


def test_launching_from_a_threaded_grpc_process_never_hangs(tmp_path: Path) -> None:
    """A launcher with gRPC calls in flight on another thread starts 40 children in turn (each waited
    for): the whole run finishes (a deadlocked fork would leave it stuck until the timeout)."""
    script = textwrap.dedent(
        """
        import threading
        from pathlib import Path
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from kvpool.cluster.process import RoleProcess
        server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(4))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        stop = threading.Event()
        def poll():
            while not stop.is_set():
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        threads = [threading.Thread(target=poll, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for i in range(40):
            role = RoleProcess(f"r{i}", [], argv=["sh", "-c", "echo KVPOOL_READY {}"],
                               log_path=Path(TMP) / f"r{i}.log")
            role.wait_ready(30)
            role.stop()
        stop.set()
        for t in threads:
            t.join(10)
        server.stop(None).wait(10)
        print("done", flush=True)
        """
    ).replace("TMP", repr(str(tmp_path)))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "done"


def test_the_launchers_fork_through_no_python_callback() -> None:
    """No `preexec_fn` anywhere in the product: it would force a full fork() of a threaded launcher."""
    root = Path(__file__).resolve().parent.parent / "kvpool"
    users = [str(p) for p in root.rglob("*.py") if "preexec_fn=" in p.read_text()]
    assert users == []


def test_sigterm_reaches_the_exec_d_program_not_a_wrapper() -> None:
    """The wrapper execs: the pid the launcher holds is the program's (its signals reach the program)."""
    proc = subprocess.Popen(die_with_parent(["sleep", "60"]))
    _wait_exec(proc.pid, b"sleep")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM
