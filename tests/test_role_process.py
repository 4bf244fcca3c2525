"""RoleProcess: a role that never announces itself fails with its log, and a launcher told to stop while
roles start stops at once (Ctrl-C/SIGTERM during `kvpool up`'s start)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from kvpool.cluster.process import NodeStartFailed, RoleProcess

_SILENT = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(120)"]


def test_a_role_that_never_gets_ready_fails_with_its_log(tmp_path: Path) -> None:
    proc = RoleProcess("slow0", [], log_path=tmp_path / "slow0.log", argv=_SILENT)
    with pytest.raises(NodeStartFailed, match=r"(?s)slow0 did not become ready:.*\[slow0\] loading"):
        proc.wait_ready(1.5)
    assert not proc.alive


@pytest.mark.parametrize("ready_url", ["", "http://127.0.0.1:9/health"], ids=["ready-line", "ready-url"])
def test_cancel_stops_the_wait_and_the_role_at_once(tmp_path: Path, ready_url: str) -> None:
    proc = RoleProcess("slow1", [], log_path=tmp_path / "slow1.log", argv=_SILENT, ready_url=ready_url)
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(NodeStartFailed, match=r"start cancelled"):
        proc.wait_ready(120, cancel=cancel)
    assert time.monotonic() - t0 < 15  # not the 120 s start timeout
    assert not proc.alive


def test_a_start_timeout_says_it_is_one(tmp_path: Path) -> None:
    """Found by a new-user pass: `kvpool up --timeout-s 1` said only "did not become ready", with a log
    tail that could end in the role's READY line (it came just after the deadline)."""
    proc = RoleProcess("slow2", [], log_path=tmp_path / "slow2.log", argv=_SILENT)
    with pytest.raises(NodeStartFailed, match=r"slow2: no answer within 1.5 s \(the start timeout"):
        proc.wait_ready(1.5)
    quits = [sys.executable, "-c", "raise SystemExit(3)"]
    gone = RoleProcess(
        "gone0", [], log_path=tmp_path / "gone0.log", argv=quits, ready_url="http://127.0.0.1:9/"
    )
    with pytest.raises(NodeStartFailed, match="gone0 exited with code 3"):
        gone.wait_ready(30)
