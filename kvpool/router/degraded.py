"""What the router sees degraded, why and since when: the master, and serving nodes in back-off.

`MasterState` follows the router's calls to the master: the first failed call marks it unreachable
(reason and wall-clock time), the next answered call marks it reachable again; each change is logged
once. `DegradedPart` is one degraded part as `/health` and `kvpool_router_degraded_since_seconds` show
it (`part`: "master" or "<role> <node id>"; `since_unix_s`: seconds since the epoch).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DegradedPart:
    """One degraded part: what, why, since when (Unix seconds)."""

    part: str
    reason: str
    since_unix_s: float

    def as_dict(self, now_unix_s: float | None = None) -> dict[str, Any]:
        """JSON shape of `/health`: part, reason, since (ISO 8601, UTC) and for_s (seconds, 0.1 s)."""
        now = time.time() if now_unix_s is None else now_unix_s
        since = dt.datetime.fromtimestamp(self.since_unix_s, tz=dt.UTC).isoformat(timespec="seconds")
        return {
            "part": self.part,
            "reason": self.reason,
            "since": since.replace("+00:00", "Z"),
            "for_s": round(max(0.0, now - self.since_unix_s), 1),
        }


class MasterState:
    """Thread-safe record of the master's reachability as the router's calls see it."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._lock = threading.Lock()
        self._reason = ""
        self._since_unix_s = 0.0
        self._ever_reached = False

    @property
    def down(self) -> bool:
        """The last call to the master failed (and none answered since)."""
        return bool(self._reason)

    @property
    def ever_reached(self) -> bool:
        """Some call to the master answered since the router started."""
        return self._ever_reached

    def answered(self) -> None:
        """A call to the master answered."""
        with self._lock:
            was, since = self._reason, self._since_unix_s
            self._reason, self._ever_reached = "", True
        if was:
            log.warning(
                "master %s answers again after %.1f s: peeks and hits resume",
                self.address,
                time.time() - since,
            )

    def failed(self, exc: BaseException) -> None:
        """A call to the master failed (`exc` says why); the first of an outage is logged."""
        why = str(exc) or type(exc).__name__
        with self._lock:
            first = not self._reason
            self._reason = why
            if first:
                self._since_unix_s = time.time()
        if first:
            log.warning(
                "master %s unreachable (%s): routing on the known nodes without hits", self.address, why
            )

    def part(self) -> DegradedPart | None:
        """The master as a degraded part; None while it answers."""
        with self._lock:
            if not self._reason:
                return None
            reason = f"master {self.address} unreachable: {self._reason}"
            if not self._ever_reached:
                reason += " (never reached since the router started)"
            return DegradedPart("master", reason, self._since_unix_s)

    def why_no_node(self, role: str) -> str:
        """Why no `role` node is known, for a 503: the master's state is the usual cause."""
        part = self.part()
        if part is None:
            return f"no live {role} node (the master lists none)"
        if not self._ever_reached:
            return f"no live {role} node known: {part.reason}"
        return f"no live {role} node known while the {part.reason}"
