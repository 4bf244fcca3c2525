"""Supervised roles of `kvpool up`: the restart policy (back-off, give-up window) on an injected clock, the
ports a restarted role keeps, a role refused at its first start (exit 2) given up on at once, and `kvpool up`
ending with one line naming it (a real cluster spec whose store cannot start). The restarts of a real cluster's roles after
kill -9 are in tests/test_up_supervised.py (slow)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvpool.cluster.process import NodeStartFailed, wait_for
from kvpool.cluster.spec import load_spec
from kvpool.cluster.supervise import (
    CrashHistory,
    GaveUp,
    RestartPolicy,
    SupervisedRole,
    describe_exit,
    pin_ports,
    stop_roles,
)
from kvpool.errors import InvalidArgument


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_back_off_doubles_is_capped_and_gives_up_after_max_restarts_within_the_window() -> None:
    clock = _Clock()
    history = CrashHistory(
        RestartPolicy(backoff_s=1.0, backoff_max_s=5.0, max_restarts=4, window_s=60.0), clock
    )
    delays = []
    for _ in range(4):
        delays.append(history.crashed())
        clock.now += 10.0
    assert delays == [1.0, 2.0, 4.0, 5.0]  # doubled, then capped at backoff_max_s
    assert history.crashed() is None  # the 5th crash within 60 s: give up
    assert history.recent == 5


def test_crashes_older_than_the_window_are_forgotten() -> None:
    clock = _Clock()
    history = CrashHistory(
        RestartPolicy(backoff_s=0.5, backoff_max_s=30.0, max_restarts=2, window_s=60.0), clock
    )
    assert history.crashed() == 0.5
    clock.now += 30.0
    assert history.crashed() == 1.0
    clock.now += 31.0  # the first crash left the window: this is the 2nd within it, not the 3rd
    assert history.crashed() == 1.0
    clock.now += 1.0
    assert history.crashed() is None  # 3 within 60 s > max_restarts = 2


def test_max_restarts_zero_gives_up_on_the_first_crash() -> None:
    assert CrashHistory(RestartPolicy(max_restarts=0), _Clock()).crashed() is None


def test_describe_exit() -> None:
    assert describe_exit(2) == "exit code 2"
    assert describe_exit(-9) == "signal 9 (SIGKILL)"
    assert describe_exit(None) == "still running"


def test_a_restart_binds_the_ports_the_role_got_the_first_time() -> None:
    store = ["store", "--master", "m:1", "--grpc-port", "0", "--data-port", "0", "--node-id", "store0"]
    info = {"grpc_address": "127.0.0.1:41001", "data_address": "127.0.0.1:41002",
            "metrics_address": "127.0.0.1:41003"}  # fmt: skip
    assert pin_ports(store, info) == [
        "store", "--master", "m:1", "--grpc-port", "41001", "--data-port", "41002", "--node-id", "store0",
        "--metrics-port", "41003",
    ]  # fmt: skip
    node = ["decode", "--port", "0", "--node-id", "decode0", "--metrics-port", "9100"]
    assert pin_ports(node, {"grpc_address": "127.0.0.1:41004", "metrics_address": "127.0.0.1:9100"}) == [
        "decode", "--port", "41004", "--node-id", "decode0", "--metrics-port", "9100",
    ]  # fmt: skip
    router = ["router", "--master", "127.0.0.1:5", "--port", "0"]
    assert pin_ports(router, {"http_address": "127.0.0.1:41005", "role": "router"}) == [
        "router", "--master", "127.0.0.1:5", "--port", "41005",
    ]  # fmt: skip
    assert pin_ports(["master", "--port", "0"], {"grpc_address": "h:7", "metrics_address": ""}) == [
        "master", "--port", "7",
    ]  # fmt: skip


def test_a_role_that_crashes_at_start_is_restarted_then_given_up_on(tmp_path: Path) -> None:
    """A real child process that exits 3 at once: two restarts (one line each), then `GaveUp` naming it
    with its exit code and its last log line."""
    said: list[str] = []
    crash = [sys.executable, "-c", "import sys; print('no such thing'); sys.exit(3)"]
    policy = RestartPolicy(backoff_s=0.05, backoff_max_s=0.1, max_restarts=2, window_s=60.0)
    role = SupervisedRole("flaky0", [], argv=crash, log_path=tmp_path / "flaky0.log", env={},
                          policy=policy, say=said.append)  # fmt: skip
    with pytest.raises(GaveUp) as caught:
        role.wait_ready(30.0, threading.Event())
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("giving up on flaky0: it crashed 3 times within 60 s (max_restarts = 2)")
    assert "last: exit code 3: no such thing" in message
    assert said == [
        "flaky0 exited (exit code 3); restarting it in 0.05 s on the same ports",
        "flaky0 exited (exit code 3); restarting it in 0.1 s on the same ports",
    ]
    assert role.restarts == 2
    never = RestartPolicy(max_restarts=0)  # no restart: the first crash gives up
    once = SupervisedRole("flaky1", [], argv=crash, log_path=tmp_path / "flaky1.log", env={}, policy=never,
                          say=said.append)  # fmt: skip
    with pytest.raises(
        GaveUp, match=r"^giving up on flaky1: it crashed once within 60 s \(max_restarts = 0\)"
    ):
        once.wait_ready(30.0, threading.Event())
    assert len(said) == 2 and once.restarts == 0


def test_ctrl_c_during_a_back_off_stops_at_once(tmp_path: Path) -> None:
    crash = [sys.executable, "-c", "raise SystemExit(4)"]
    slow = RestartPolicy(backoff_s=120.0, backoff_max_s=120.0)
    cancel = threading.Event()
    said: list[str] = []

    def say(line: str) -> None:  # the crash is announced, then Ctrl-C comes within its 120 s back-off
        said.append(line)
        cancel.set()

    role = SupervisedRole("flaky2", [], argv=crash, log_path=tmp_path / "flaky2.log", env={}, policy=slow,
                          say=say)  # fmt: skip
    with pytest.raises(NodeStartFailed, match="flaky2: start cancelled"):
        role.wait_ready(60.0, cancel)
    assert said == ["flaky2 exited (exit code 4); restarting it in 120 s on the same ports"]
    assert role.restarts == 0 and not role.proc.alive


def test_a_role_that_serves_then_keeps_crashing_is_restarted_then_given_up_on(tmp_path: Path) -> None:
    """`kvpool up`'s supervision loop over a real child that announces itself, serves 0.3 s and exits 5:
    restarted after each crash (each restart served again), then `GaveUp`."""
    from kvpool.cli.up_cmd import _supervise

    serves = [
        sys.executable,
        "-c",
        "import time; print('KVPOOL_READY {}', flush=True); time.sleep(0.3); exit(5)",
    ]
    said: list[str] = []
    policy = RestartPolicy(backoff_s=0.05, backoff_max_s=0.05, max_restarts=2, window_s=60.0)
    role = SupervisedRole("short0", [], argv=serves, log_path=tmp_path / "short0.log", env={}, policy=policy,
                          say=said.append)  # fmt: skip
    stop = threading.Event()
    role.wait_ready(30.0, stop)
    with pytest.raises(GaveUp, match=r"^giving up on short0: it crashed 3 times .* last: exit code 5"):
        _supervise([role], 30.0, stop)
    assert said == ["short0 exited (exit code 5); restarting it in 0.05 s on the same ports"] * 2
    assert role.restarts == 2 and role.log_path.read_text().count("KVPOOL_READY") == 3


def test_a_role_refused_at_its_first_start_is_not_restarted(tmp_path: Path) -> None:
    """Exit 2 before it ever served (a bad setting, a port in use, the master's refusal): `GaveUp` at once,
    one line with its last log line, no restart (a restart would be refused the same way)."""
    said: list[str] = []
    refused = [sys.executable, "-c", "import sys; print('port 50051 is in use'); sys.exit(2)"]
    role = SupervisedRole("master", [], argv=refused, log_path=tmp_path / "master.log", env={},
                          policy=RestartPolicy(backoff_s=0.05), say=said.append)  # fmt: skip
    with pytest.raises(GaveUp) as caught:
        role.wait_ready(30.0, threading.Event())
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("master refused to start (exit code 2): port 50051 is in use (log: ")
    assert message.endswith("not restarted: the same settings would be refused again")
    assert said == [] and role.restarts == 0


def test_a_role_that_served_is_restarted_after_exit_2(tmp_path: Path) -> None:
    """Exit 2 after a role served once (its old process may still hold its port): restarted as a crash."""
    from kvpool.cli.up_cmd import _supervise

    marker = tmp_path / "served"
    once = [sys.executable, "-c",
            f"import pathlib, sys, time; m = pathlib.Path({str(marker)!r})\n"
            "if m.exists(): print('port in use'); sys.exit(2)\n"
            "m.touch(); print('KVPOOL_READY {}', flush=True); time.sleep(0.3); sys.exit(2)"]  # fmt: skip
    said: list[str] = []
    policy = RestartPolicy(backoff_s=0.05, backoff_max_s=0.05, max_restarts=1, window_s=60.0)
    role = SupervisedRole("store0", [], argv=once, log_path=tmp_path / "store0.log", env={}, policy=policy,
                          say=said.append)  # fmt: skip
    stop = threading.Event()
    role.wait_ready(30.0, stop)
    with pytest.raises(GaveUp, match=r"^giving up on store0: it crashed 2 times .* last: exit code 2"):
        _supervise([role], 30.0, stop)
    assert said == ["store0 exited (exit code 2); restarting it in 0.05 s on the same ports"]
    assert role.restarts == 1


def test_a_start_timeout_is_not_a_crash(tmp_path: Path) -> None:
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    role = SupervisedRole("mute0", [], argv=silent, log_path=tmp_path / "mute0.log", env={},
                          policy=RestartPolicy(), say=print)  # fmt: skip
    with pytest.raises(NodeStartFailed, match="no answer within 1 s") as caught:
        role.wait_ready(1.0, threading.Event())
    assert caught.value.exit_code is None and role.restarts == 0


def test_spec_restart_settings(tmp_path: Path) -> None:
    p = tmp_path / "cluster.toml"
    p.write_text("[cluster]\nrestart_backoff_s = 2\nmax_restarts = 1\nrestart_window_s = 5\n")
    assert RestartPolicy.of(load_spec(p).cluster) == RestartPolicy(2.0, 30.0, 1, 5.0)
    p.write_text("[cluster]\nrestart_backoff_s = 10\nrestart_backoff_max_s = 5\n")
    with pytest.raises(
        InvalidArgument, match=r":1: cluster: restart_backoff_max_s must be >= restart_backoff_s"
    ):
        load_spec(p)


def test_up_ends_with_one_line_naming_a_role_refused_at_its_first_start(tmp_path: Path) -> None:
    """A store whose segment cannot hold one block exits 2 at its first start: `kvpool up` does not restart
    it; it stops the cluster and exits 1 with one line naming it and why."""
    spec = tmp_path / "cluster.toml"
    spec.write_text("""
[cluster]
block_size = 16
restart_backoff_s = 0.1
max_restarts = 2
[master]
port = 0
[store]
count = 1
segment_size = "1B"
[router]
port = 0
""")  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec), "--quiet", "--insecure"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    refused = [line for line in out.splitlines() if "refused to start" in line]
    assert len(refused) == 1, out
    assert refused[0].startswith(
        "kvpool up: store0 refused to start (exit code 2): kvpool store: InvalidArgument: segment of 1 B cannot "
        "hold one"
    ), out
    assert "restarting" not in out, out
    assert "prefill0" not in out  # the start stopped at the store
    assert "kvpool up: stopping 1 role…" in out, out  # the master: it runs until the end
    assert re.search(r"kvpool up: stopped in \d+\.\d s\n", r.stderr), out
    assert "kvpool cluster stopped" in out


def test_stopping_says_what_it_does_and_names_each_role_it_had_to_kill(tmp_path: Path) -> None:
    """`kvpool up` stopping its roles: one line when it starts, one per role that ignored SIGTERM and was
    killed (real child processes: one exits on SIGTERM, one ignores it), one when done with the time."""
    said: list[str] = []
    polite = [sys.executable, "-c", "import time; time.sleep(60)"]
    stubborn = [
        sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
        "time.sleep(60)",
    ]  # fmt: skip
    roles = [
        SupervisedRole(
            name,
            [],
            argv=argv,
            log_path=tmp_path / f"{name}.log",
            env={},
            policy=RestartPolicy(),
            say=said.append,
        )  # fmt: skip
        for name, argv in (("master", polite), ("decode0", stubborn), ("router", polite))
    ]
    log = tmp_path / "decode0.log"  # it ignores SIGTERM once it printed 'up'
    assert wait_for(lambda: log.exists() and "[decode0] up" in log.read_text(), 30.0)
    stop_roles(roles, said.append, timeout_s=0.5)
    assert not any(r.proc.alive for r in roles)
    assert said[0] == "stopping 3 roles…"
    assert said[1] == "decode0 did not exit within 0.5 s of SIGTERM: killed it (SIGKILL)"
    assert len(said) == 3 and said[2].startswith("stopped in ") and said[2].endswith(" s")
    assert roles[1].proc.proc.returncode == -9 and roles[0].proc.proc.returncode == -15
    said.clear()
    stop_roles(roles, said.append)  # nothing runs any more: nothing to say
    assert said == []
