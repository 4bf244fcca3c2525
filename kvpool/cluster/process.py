"""Start one kvpool role as a child process and wait for its `KVPOOL_READY {json}` line.

Every role command prints exactly one `KVPOOL_READY <json>` line on stdout when it serves (its bound
addresses in the JSON), so a parent never guesses ports. Children die with their parent on Linux
(`PR_SET_PDEATHSIG`), so a killed launcher leaves no orphans.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvpool.errors import KVPoolError
from kvpool.rpc.process import READY_PREFIX, die_with_parent

log = logging.getLogger(__name__)


class NodeStartFailed(KVPoolError, RuntimeError):
    """A node process died or stalled before it reported ready; the message carries its log's tail.
    `exit_code`: the process's return code when it exited by itself (a crash), else None (it did not
    answer in time, or the wait was cancelled)."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RoleProcess:
    """A running role process (`kvpool <role> …`, or any `argv`: a vLLM server). Its output goes to
    `log_path`, prefixed by name. It is ready when it prints its READY line, or (with `ready_url`) when
    that URL answers 200."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        *,
        log_path: Path,
        env: dict[str, str] | None = None,
        argv: Sequence[str] = (),
        ready_url: str = "",
    ) -> None:
        self.name = name
        self.args = list(args)
        self.log_path = log_path
        self.ready_url = ready_url
        self.info: dict[str, Any] = {}
        cmd = die_with_parent(list(argv) or [sys.executable, "-m", "kvpool.cli.main", *self.args])
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=child_env,
        )
        self._ready: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._pump = threading.Thread(target=self._pump_output, name=f"log-{name}", daemon=True)
        self._pump.start()

    def _pump_output(self) -> None:
        assert self.proc.stdout is not None
        out: IO[str]
        with self.log_path.open("a") as out:
            for line in self.proc.stdout:
                if line.startswith(READY_PREFIX):
                    try:
                        self._ready.put(json.loads(line[len(READY_PREFIX) :]))
                    except json.JSONDecodeError:
                        self._ready.put(None)
                out.write(f"[{self.name}] {line}")
                out.flush()
        self._ready.put(None)

    def wait_ready(self, timeout_s: float = 60.0, cancel: threading.Event | None = None) -> dict[str, Any]:
        """Block until the READY line arrives (or `ready_url` answers 200: then the info is {"url": the URL's
        scheme://host:port}); `NodeStartFailed` (a `RuntimeError`) with the log tail if the child dies or
        stalls, or at once when `cancel` is set (a launcher told to stop while its roles start)."""
        if self.ready_url:
            return self._wait_url(timeout_s, cancel)
        deadline = time.monotonic() + timeout_s
        info: dict[str, Any] | None = None
        while (left := deadline - time.monotonic()) > 0 and not (cancel and cancel.is_set()):
            try:
                info = self._ready.get(timeout=min(left, 0.25))
                break
            except queue.Empty:
                continue
        if info is None:
            code = self._crash_code(cancel)
            why, after = self._why(timeout_s, cancel)
            self.stop()
            raise NodeStartFailed(f"{self.name} did not become ready{why}:\n{self.log_tail()}{after}", code)
        self.info = info
        return info

    def _why(self, timeout_s: float, cancel: threading.Event | None) -> tuple[str, str]:
        """Why the wait ended, as (a note before the log tail, a line after it): cancelled, the start
        timeout passed while the process runs, or it exited."""
        if cancel and cancel.is_set():
            return " (start cancelled)", ""
        if self.alive:
            return (
                "",
                f"\n{self.name}: no answer within {timeout_s:g} s (the start timeout: kvpool up --timeout-s)",
            )
        return "", f"\n{self.name} exited with code {self.proc.returncode}"

    def _wait_url(self, timeout_s: float, cancel: threading.Event | None) -> dict[str, Any]:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while self.alive and time.monotonic() < deadline and not (cancel and cancel.is_set()):
            try:
                with urllib.request.urlopen(self.ready_url, timeout=2.0) as resp:
                    if resp.status == 200:
                        scheme, _, rest = self.ready_url.partition("://")
                        self.info = {"url": f"{scheme}://{rest.split('/', 1)[0]}"}
                        return self.info
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        code = self._crash_code(cancel)
        why, after = self._why(timeout_s, cancel)
        self.stop()
        raise NodeStartFailed(
            f"{self.name} did not become ready ({self.ready_url}){why}:\n{self.log_tail()}{after}", code
        )

    def _crash_code(self, cancel: threading.Event | None) -> int | None:
        """Its return code when it exited by itself before it served, else None."""
        if cancel and cancel.is_set():
            return None
        self._pump.join(timeout=0.2)
        if not self._pump.is_alive():  # its output ended: it exits, or has
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2.0)
        return self.proc.poll()

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text().splitlines(keepends=True)[-num_lines:])
        except OSError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """kill -9 (fault injection)."""
        if self.alive:
            self.proc.kill()
        self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """SIGTERM, then SIGKILL after `timeout_s`; returns whether it had to be killed (it did not exit
        within `timeout_s` of the SIGTERM)."""
        killed = False
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            if not self._wait_exit(timeout_s):
                self.proc.kill()
                killed = True
            self.proc.wait()  # a blocking waitpid: releases the GIL while it waits
        self._pump.join(timeout=2.0)
        return killed

    def _wait_exit(self, timeout_s: float) -> bool:
        """Whether the process exits within `timeout_s`. Waits in one `select` on a pidfd (Linux), not in
        `Popen.wait(timeout)`'s sleep loop, which needs the GIL every few ms and can be starved for
        minutes by a busy thread in this process (a UCX progress thread spinning on dead endpoints)."""
        try:
            fd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3, or already reaped
            try:
                self.proc.wait(timeout=timeout_s)
                return True
            except subprocess.TimeoutExpired:
                return False
        try:
            ready, _, _ = select.select([fd], [], [], timeout_s)
        finally:
            os.close(fd)
        return bool(ready)


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll `predicate()` until true or `timeout_s` passes; returns the last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
