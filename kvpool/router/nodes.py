"""The router's view of the cluster's serving nodes: the master's node list and the nodes' back-off.

The node list comes from the master, refreshed in the background every `refresh_interval_s`; requests
use the cached list. A failed peek means no hits, never a failed request: when a call to the master
fails (`kvpool.router.degraded.MasterState`) the router keeps routing on the last serving nodes it knows
(the master's last list, or the last non-empty one of each role), with no peeks (placement reads the
router's own record of where recent prefixes went, `kvpool.router.affinity`), until a refresh — the
background probe every `refresh_interval_s` — answers again. `/health` then says `degraded` (HTTP
200) with the reason and since when. Only a router that knows no live node of a role answers 503, with
the reason (a master never reached since start: its error). When the master answers but lists no
serving node of a role (a restarted master knows none until each re-registers, a heartbeat or two), the
last ones seen within `node_grace_s` keep serving.

A node that died is listed alive until the master's heartbeat timeout (or for the whole outage while the
master is unreachable). Failover (as production routers do): a call to a prefill or decode node that
fails UNAVAILABLE (connection refused or reset, the node gone) before anything of that call was sent to
the client puts the node in a local back-off of `node_backoff_s` (keyed by node id and epoch; it ends
early when the node answers a call) and the request is retried on the next node the same policy chooses
among the others, up to `node_retries` times. Nodes in back-off are left out of placement unless every
candidate is in back-off (then all are tried: a back-off is a hint, not a verdict). No other node left:
`Unavailable` naming the failure. Other errors are not retried. Each retry is counted in
`kvpool_router_retries_total{role}`; the master and the nodes in back-off are the degraded parts of
`/health` and `kvpool_router_degraded_since_seconds`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from typing import Any

from kvpool.client.types import NodeStatus
from kvpool.errors import KVPoolError, Unavailable
from kvpool.router.degraded import DegradedPart, MasterState
from kvpool.router.metrics import RouterMetrics
from kvpool.router.settings import RouterSettings
from kvpool.router.state import serving_nodes

log = logging.getLogger(__name__)


class NodeView:
    """The node list (cached, refreshed by `start`ed subclasses), the master's state and the back-off of
    unreachable nodes."""

    def __init__(self, settings: RouterSettings, master: Any, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.master = master
        self.metrics = metrics
        self.master_state = MasterState(settings.master)
        self._nodes: list[NodeStatus] = []
        self._nodes_at = 0.0
        self._nodes_lock = threading.Lock()
        self._last_serving: dict[str, tuple[list[NodeStatus], float]] = {}
        # (node id, epoch) -> (end of its back-off (monotonic s), "role node id", since (Unix s))
        self._down: dict[tuple[str, int], tuple[float, str, float]] = {}
        self._down_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        metrics.watch_degraded(self.degraded_parts, lambda: not self.master_state.down)

    def start_refresh(self) -> None:
        """Refresh the node list every `refresh_interval_s` on a daemon thread until `stop_refresh` (while
        the master is unreachable this is its probe)."""
        self._thread = threading.Thread(target=self._refresh_loop, name="router-refresh", daemon=True)
        self._thread.start()

    def stop_refresh(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.settings.refresh_interval_s):
            try:
                self.refresh()
            except Unavailable as exc:  # noted by refresh() (logged once per outage): the known nodes serve
                log.debug("node list refresh failed: %s", exc)

    def refresh(self) -> list[NodeStatus]:
        """The master's node list now (cached for requests); `Unavailable` when the master does not answer
        (the master is then marked unreachable; the cached list stays, as the last known nodes)."""
        try:
            nodes = self.master.list_nodes()
        except Exception as exc:  # noqa: BLE001 - any failure: the master's view is unknown
            self.master_failed(exc)
            raise Unavailable(f"master unreachable: {exc}") from None
        with self._nodes_lock:
            self._nodes, self._nodes_at = nodes, time.monotonic()
        self.master_state.answered()
        return nodes

    def probe_master(self) -> bool:
        """Ask the master for the node list now: whether it answered (a failure is noted, not raised)."""
        try:
            self.refresh()
        except Unavailable:
            return False
        return True

    def check_master(self) -> None:
        """For `/health`: ask the master now, unless it is known unreachable and the background probe
        runs (its state is then at most `refresh_interval_s` old: a health check never waits on it)."""
        if not (self.master_state.down and self._thread is not None):
            self.probe_master()

    def master_failed(self, exc: BaseException) -> None:
        """A master call failed: no peeks and no synchronous master calls until a refresh answers."""
        self.master_state.failed(exc)

    def nodes(self) -> list[NodeStatus]:
        """The cached node list while fresh (at most 4 refresh periods old); else the master's answer now,
        unless the master is unreachable and the background probe runs (then the last known list). Never
        raises: with the master unreachable it is the last list the master gave ([] if none)."""
        with self._nodes_lock:
            nodes, age = self._nodes, time.monotonic() - self._nodes_at
        down = self.master_state.down
        if (down and self._thread is not None) or (not down and age <= 4 * self.settings.refresh_interval_s):
            return nodes
        try:
            return self.refresh()
        except Unavailable:
            return nodes

    def serving(self, role: str) -> list[NodeStatus]:
        """The live nodes of `role`. While the master is unreachable: those of its last list, or if that
        had none, the last ones seen (however long ago). When the master answers but lists none, the last
        ones seen within `node_grace_s`. A node that is really gone fails its call and goes into back-off."""
        nodes = serving_nodes(self.nodes(), role)
        now = time.monotonic()
        with self._nodes_lock:
            if nodes:
                self._last_serving[role] = (nodes, now)
                return nodes
            last = self._last_serving.get(role)
        if last is not None and (self.master_state.down or now - last[1] <= self.settings.node_grace_s):
            return last[0]
        return []

    def no_node(self, role: str) -> Unavailable:
        """The error for a request that finds no live `role` node, saying why (the master's state)."""
        return Unavailable(self.master_state.why_no_node(role))

    def degraded_parts(self) -> list[DegradedPart]:
        """The master when unreachable, then each node in back-off (by part name)."""
        parts = [p] if (p := self.master_state.part()) is not None else []
        now = time.monotonic()
        with self._down_lock:
            down = sorted((v for v in self._down.values() if v[0] > now), key=lambda v: v[1])
        parts += [DegradedPart(name, "unreachable: in back-off", since) for _, name, since in down]
        return parts

    def health_report(self, prefill: int, decode: int, **extra: Any) -> dict[str, Any]:
        """`/health`'s body: status ("ok", "degraded": serving with degraded parts, "unavailable": no live
        prefill or decode node known, with `error` saying why), the live node counts, `degraded` (list of
        `DegradedPart.as_dict`) and `extra`."""
        parts = [p.as_dict() for p in self.degraded_parts()]
        body: dict[str, Any] = {"status": "ok", "prefill": prefill, "decode": decode, **extra}
        if not (prefill and decode):
            body["status"] = "unavailable"
            body["error"] = self.master_state.why_no_node("prefill" if not prefill else "decode")
        elif parts:
            body["status"] = "degraded"
        if parts:
            body["degraded"] = parts
        return body

    # ---- node back-off (failover) -----------------------------------------------------------------
    def node_failed(self, role: str, node: NodeStatus) -> None:
        """A call could not reach `node`: leave it out of placement for `node_backoff_s`."""
        now = time.monotonic()
        key = (node.node.node_id, node.node.epoch)
        with self._down_lock:
            self._down = {k: v for k, v in self._down.items() if v[0] > now}
            since = self._down[key][2] if key in self._down else time.time()
            self._down[key] = (now + self.settings.node_backoff_s, f"{role} {node.node.node_id}", since)
        self.metrics.node_failures.labels(role, node.node.node_id).inc()

    def node_answered(self, node: NodeStatus) -> None:
        """`node` served a call: its back-off, if any, ends."""
        if self._down:
            with self._down_lock:
                self._down.pop((node.node.node_id, node.node.epoch), None)

    def in_backoff(self, node: NodeStatus) -> bool:
        with self._down_lock:
            entry = self._down.get((node.node.node_id, node.node.epoch))
        return entry is not None and entry[0] > time.monotonic()

    def candidates(self, role: str, exclude: Collection[str] = ()) -> list[NodeStatus]:
        """The live nodes of `role` but `exclude` (node ids), those in back-off left out unless all are."""
        nodes = [n for n in self.serving(role) if n.node.node_id not in exclude]
        return [n for n in nodes if not self.in_backoff(n)] or nodes

    def _call_failed(self, role: str, node: NodeStatus, exc: KVPoolError, tried: list[str]) -> str:
        """A call to `node` failed (`exc`: the `kvpool.client.NodeClient` call's error) before anything of
        it was sent to the client. When it could not reach the node (`Unavailable`) and another node is
        left: the node goes into back-off, the retry is counted and the failure returned (for the log);
        otherwise raises the call's error, naming the node."""
        what = f"{role} on {node.node.node_id}"
        if not isinstance(exc, Unavailable):
            raise type(exc)(f"{what}: {exc}") from None
        details = str(exc)
        self.node_failed(role, node)
        tried.append(node.node.node_id)
        others = self.candidates(role, tried)
        if not others or len(tried) > self.settings.node_retries:
            why = (
                f"gave up after {len(tried)} {role} nodes" if others else f"no other {role} node to retry on"
            )
            raise Unavailable(f"{what}: {details}; {why} (tried {', '.join(tried)})")
        self.metrics.retries.labels(role).inc()
        return f"{what} unreachable ({details}): in back-off for {self.settings.node_backoff_s:g} s"
