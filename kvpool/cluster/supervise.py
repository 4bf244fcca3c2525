"""Supervised roles of `kvpool up`: a crashed role restarts after a back-off on the same ports and node id,
and repeated crashes within a window give up; a role that refuses to start (exit 2) before it ever served
is not restarted.

`RestartPolicy` is the rule (the `[cluster] restart_*` / `max_restarts` keys of the cluster spec),
`CrashHistory` applies it to one role's crashes (clock injected for tests), `SupervisedRole` is one role
of the cluster: its current `RoleProcess`, the arguments it restarts with (ephemeral ports replaced by the
ports it got the first time, read from its READY line) and its crash history.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.cluster.process import NodeStartFailed, RoleProcess

# `--flag` of a role command -> the READY key whose address holds the port that flag binds
_PORT_FLAGS = (
    ("--grpc-port", "grpc_address"),
    ("--data-port", "data_address"),
    ("--metrics-port", "metrics_address"),
)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """A role's `n`-th crash within `window_s` seconds restarts it after `backoff_s * 2**(n-1)` seconds
    (at most `backoff_max_s`) while `n <= max_restarts`; one more crash within the window gives up."""

    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 60.0

    @classmethod
    def of(cls, cluster: Any) -> RestartPolicy:
        """From a spec's `[cluster]` section (`ClusterSection`)."""
        return cls(cluster.restart_backoff_s, cluster.restart_backoff_max_s, cluster.max_restarts,
                   cluster.restart_window_s)  # fmt: skip


class CrashHistory:
    """One role's crashes within the policy's window; `crashed()` records one and says what to do."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self._times: list[float] = []

    @property
    def recent(self) -> int:
        """Crashes within the window, the last one included."""
        return len(self._times)

    def crashed(self) -> float | None:
        """Record a crash now; returns the delay before the restart (seconds), or None: give up."""
        now = self._clock()
        self._times = [t for t in self._times if now - t < self.policy.window_s] + [now]
        n = len(self._times)
        if n > self.policy.max_restarts:
            return None
        return min(self.policy.backoff_s * 2 ** (n - 1), self.policy.backoff_max_s)


def describe_exit(returncode: int | None) -> str:
    """`exit code 2`, `signal 9 (SIGKILL)` (a negative Popen return code), or `still running`."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _port_of(address: str) -> str:
    return address.rsplit(":", 1)[1].rstrip("/") if ":" in address else ""


def pin_ports(args: Sequence[str], info: dict[str, Any]) -> list[str]:
    """`args` of a role command with every port it bound (as its READY line `info` names them) written
    in: a role started on port 0 restarts on the port it got the first time, so its peers and clients
    find it where they knew it. `--port` is the router's HTTP port or a node's or master's gRPC port."""
    out = list(args)
    flags = [*_PORT_FLAGS, ("--port", "http_address" if "http_address" in info else "grpc_address")]
    for flag, key in flags:
        port = _port_of(str(info.get(key) or ""))
        if not port:
            continue
        if flag in out:
            out[out.index(flag) + 1] = port
        elif flag == "--metrics-port":  # every role that announces /metrics takes it; others are in args
            out += [flag, port]
    return out


def _how_often(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def last_words(log_tail: str, name: str, limit: int = 160) -> str:
    """The last non-empty line of a role's log, without its `[name] ` prefix, at most `limit` chars."""
    lines = [ln.removeprefix(f"[{name}] ").strip() for ln in log_tail.splitlines()]
    last = next((ln for ln in reversed(lines) if ln), "")
    return last if len(last) <= limit else last[: limit - 1] + "…"


REFUSED_EXIT = 2
"""The exit status of a role command that refuses to start: a bad setting, a port in use, a refusal by the
master (the house's usage-error status)."""


class GaveUp(RuntimeError):
    """A role crashed more often than its restart policy allows; the message is one line naming it."""


class SupervisedRole:
    """One local role of `kvpool up`: `kvpool <args>` (or `argv`: a vLLM engine), restarted after a
    crash with the ports it bound the first time. `say` prints one line for the user."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        *,
        log_path: Path,
        env: dict[str, str],
        policy: RestartPolicy,
        say: Callable[[str], None],
        argv: Sequence[str] = (),
        ready_url: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.args, self.argv = name, list(args), list(argv)
        self.log_path, self.env, self.ready_url = log_path, env, ready_url
        self.history = CrashHistory(policy, clock)
        self._say = say
        self.restarts = 0
        self.served = False
        """It has served at least once (a refusal after that may be passing: a port its old process holds)."""
        self.restart_at: float | None = None
        """When a crashed role is due to restart (`time.monotonic()`); None while it runs."""
        self.proc = self._spawn()

    def _spawn(self) -> RoleProcess:
        return RoleProcess(self.name, self.args, log_path=self.log_path, env=self.env, argv=self.argv,
                           ready_url=self.ready_url)  # fmt: skip

    @property
    def info(self) -> dict[str, Any]:
        return self.proc.info

    @property
    def crashed(self) -> bool:
        """It exited on its own and is not yet scheduled to restart."""
        return self.restart_at is None and not self.proc.alive

    def wait_ready(self, timeout_s: float, cancel: threading.Event) -> dict[str, Any]:
        """Wait until it serves, restarting it after each crash as the policy allows (waits cancelled by
        `cancel`). Raises `GaveUp` (one line) after too many crashes, `NodeStartFailed` when it does not
        answer within `timeout_s` or `cancel` is set. Later restarts reuse the ports it bound."""
        while True:
            try:
                info = self.proc.wait_ready(timeout_s, cancel=cancel)
            except NodeStartFailed as exc:
                if exc.exit_code is None:  # no answer in time, or cancelled: not a crash
                    raise
                if exc.exit_code == REFUSED_EXIT and not self.served:
                    raise GaveUp(self._refused()) from None
                self.schedule_restart(exc.exit_code)
                assert self.restart_at is not None
                if cancel.wait(max(0.0, self.restart_at - time.monotonic())):
                    raise NodeStartFailed(f"{self.name}: start cancelled") from None
                self.respawn()
                continue
            if not self.argv:
                self.args = pin_ports(self.args, info)
            self.served = True
            return info

    def _refused(self) -> str:
        """The one line for a role that exited 2 (refused: a bad setting, a port in use, the master's
        refusal) before it ever served: a restart would only repeat it."""
        why = last_words(self.proc.log_tail(20), self.name)
        return (
            f"{self.name} refused to start (exit code {REFUSED_EXIT})"
            + (f": {why}" if why else "")
            + f" (log: {self.log_path}); not restarted: the same settings would be refused again"
        )

    def schedule_restart(self, returncode: int | None, *, how: str = "") -> None:
        """Its process exited with `returncode` (`how`: another reason it ended): say so in one line and
        set `restart_at`, or raise `GaveUp` when the policy allows no more restarts."""
        delay = self.history.crashed()
        how = how or describe_exit(returncode)
        if delay is None:
            p = self.history.policy
            why = last_words(self.proc.log_tail(20), self.name)
            raise GaveUp(
                f"giving up on {self.name}: it crashed {_how_often(self.history.recent)} within "
                f"{p.window_s:g} s (max_restarts = {p.max_restarts}); last: {how}"
                + (f": {why}" if why else "")
                + f" (log: {self.log_path})"
            )
        self._say(f"{self.name} exited ({how}); restarting it in {delay:g} s on the same ports")
        self.restart_at = time.monotonic() + delay

    def respawn(self) -> None:
        """Start it again with the same arguments (pinned ports, same node id)."""
        self.restart_at = None
        self.restarts += 1
        self.proc = self._spawn()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """SIGTERM, SIGKILL after `timeout_s`; returns whether it had to be killed."""
        self.restart_at = None
        return self.proc.stop(timeout_s)


def stop_roles(
    roles: Sequence[SupervisedRole],
    say: Callable[[str], None],
    *,
    timeout_s: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Stop `roles` in reverse start order (router first, master last), each with SIGTERM and SIGKILL
    after `timeout_s`, telling the user as it goes: one line when stopping starts (when any runs), one per
    role that had to be killed, one when done with the time it took."""
    running = sum(1 for r in roles if r.proc.alive)
    if running:
        say(f"stopping {running} role{'s' if running != 1 else ''}…")
    t0 = clock()
    for role in reversed(roles):
        if role.stop(timeout_s):
            say(f"{role.name} did not exit within {timeout_s:g} s of SIGTERM: killed it (SIGKILL)")
    if running:
        say(f"stopped in {clock() - t0:.1f} s")
