"""The router's view of the cluster's serving nodes: the master's node list and the nodes' back-off.

The node list comes from the master, refreshed in the background every `refresh_interval_s`. The master
down is `Unavailable` (HTTP 503): a request uses the cached node list only while the last master call
succeeded and the list is at most `4 * refresh_interval_s` old (a failed refresh or a peek the master
did not answer drops it at once).

A node that died is listed alive until the master's heartbeat timeout. Failover (as production routers
do): a call to a prefill or decode node that fails UNAVAILABLE (connection refused or reset, the node
gone) before anything of that call was sent to the client puts the node in a local back-off of
`node_backoff_s` (keyed by node id and epoch; it ends early when the node answers a call) and the request
is retried on the next node the same policy chooses among the others, up to `node_retries` times. Nodes
in back-off are left out of placement unless every candidate is in back-off (then all are tried: a
back-off is a hint, not a verdict). No other node left: `Unavailable` naming the failure. Other errors
are not retried. Each retry is counted in `kvpool_router_retries_total{role}`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from typing import Any

import grpc

from kvpool.client.types import NodeStatus
from kvpool.errors import KVPoolError, Unavailable
from kvpool.router.metrics import RouterMetrics
from kvpool.router.settings import RouterSettings
from kvpool.router.state import serving_nodes
from kvpool.rpc.status import raise_from_rpc_error

log = logging.getLogger(__name__)


class NodeView:
    """The node list (cached, refreshed by `start`ed subclasses) and the back-off of unreachable nodes."""

    def __init__(self, settings: RouterSettings, master: Any, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.master = master
        self.metrics = metrics
        self._nodes: list[NodeStatus] = []
        self._nodes_at = 0.0
        self._master_error = ""  # why the last master call failed ("": it answered)
        self._nodes_lock = threading.Lock()
        self._last_serving: dict[str, tuple[list[NodeStatus], float]] = {}
        self._down: dict[tuple[str, int], float] = {}  # (node id, epoch) -> end of its back-off
        self._down_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_refresh(self) -> None:
        """Refresh the node list every `refresh_interval_s` on a daemon thread until `stop_refresh`."""
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
            except Unavailable as exc:  # noted by refresh(): requests ask the master again, or get 503
                log.warning("node list refresh failed: %s", exc)

    def refresh(self) -> list[NodeStatus]:
        """The master's node list now (cached for requests); `Unavailable` when the master does not answer
        (and the cached list is dropped until it does)."""
        try:
            nodes = self.master.list_nodes()
        except Exception as exc:  # noqa: BLE001 - any failure: the master's view is unknown
            self.master_failed(exc)
            raise Unavailable(f"master unreachable: {exc}") from None
        with self._nodes_lock:
            self._nodes, self._nodes_at, self._master_error = nodes, time.monotonic(), ""
        return nodes

    def master_failed(self, exc: BaseException) -> None:
        """A master call failed: the cached node list is not used again until a refresh succeeds."""
        with self._nodes_lock:
            self._master_error = str(exc) or type(exc).__name__

    def nodes(self) -> list[NodeStatus]:
        """The cached node list while fresh (the last master call succeeded, at most 4 refresh periods
        ago), else the master's answer now; `Unavailable` when it does not answer."""
        with self._nodes_lock:
            nodes, age, failed = self._nodes, time.monotonic() - self._nodes_at, self._master_error
        if failed or age > 4 * self.settings.refresh_interval_s:
            nodes = self.refresh()
        return nodes

    def serving(self, role: str) -> list[NodeStatus]:
        """The live nodes of `role`. When the master lists none (a restarted master knows no serving node
        until each re-registers, which takes a heartbeat or two), the last ones seen within `node_grace_s`:
        they keep serving meanwhile; one that is really gone fails its call and the request is answered 503."""
        nodes = serving_nodes(self.nodes(), role)
        now = time.monotonic()
        with self._nodes_lock:
            if nodes:
                self._last_serving[role] = (nodes, now)
                return nodes
            last = self._last_serving.get(role)
        if last is not None and now - last[1] <= self.settings.node_grace_s:
            return last[0]
        return []

    # ---- node back-off (failover) -----------------------------------------------------------------
    def node_failed(self, role: str, node: NodeStatus) -> None:
        """A call could not reach `node`: leave it out of placement for `node_backoff_s`."""
        now = time.monotonic()
        with self._down_lock:
            self._down = {k: t for k, t in self._down.items() if t > now}
            self._down[(node.node.node_id, node.node.epoch)] = now + self.settings.node_backoff_s
        self.metrics.node_failures.labels(role, node.node.node_id).inc()

    def node_answered(self, node: NodeStatus) -> None:
        """`node` served a call: its back-off, if any, ends."""
        if self._down:
            with self._down_lock:
                self._down.pop((node.node.node_id, node.node.epoch), None)

    def in_backoff(self, node: NodeStatus) -> bool:
        with self._down_lock:
            return self._down.get((node.node.node_id, node.node.epoch), 0.0) > time.monotonic()

    def candidates(self, role: str, exclude: Collection[str] = ()) -> list[NodeStatus]:
        """The live nodes of `role` but `exclude` (node ids), those in back-off left out unless all are."""
        nodes = [n for n in self.serving(role) if n.node.node_id not in exclude]
        return [n for n in nodes if not self.in_backoff(n)] or nodes

    def _call_failed(self, role: str, node: NodeStatus, exc: grpc.RpcError, tried: list[str]) -> str:
        """A call to `node` failed before anything of it was sent to the client. When it could not reach
        the node (UNAVAILABLE) and another node is left: the node goes into back-off, the retry is counted
        and the failure returned (for the log); otherwise raises the call's error as a `KVPoolError`."""
        what = f"{role} on {node.node.node_id}"
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        if code != grpc.StatusCode.UNAVAILABLE:
            raise_from_rpc_error(exc, what)
        details = (exc.details() if hasattr(exc, "details") else "") or code.name
        self.node_failed(role, node)
        tried.append(node.node.node_id)
        try:
            others = self.candidates(role, tried)
        except KVPoolError:  # the master is gone too
            others = []
        if not others or len(tried) > self.settings.node_retries:
            why = (
                f"gave up after {len(tried)} {role} nodes" if others else f"no other {role} node to retry on"
            )
            raise Unavailable(f"{what}: {details}; {why} (tried {', '.join(tried)})")
        self.metrics.retries.labels(role).inc()
        return f"{what} unreachable ({details}): in back-off for {self.settings.node_backoff_s:g} s"
