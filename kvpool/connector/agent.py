"""A serving node's link to the master: registration, heartbeats with load, namespace registration.

When the master answers a heartbeat with `known=false` (it restarted, or declared us dead) the agent
re-registers the node and every namespace it uses, so the master's soft state comes back (DESIGN:
"a master restarted from nothing rebuilds its index from the store nodes' inventories and the nodes'
re-registered namespaces").
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvpool.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)
from kvpool.hashing import Namespace
from kvpool.types import NamespaceId

NAMESPACE_REFRESH_S = 60.0
"""A namespace in use is registered again after this long (s): the master forgets idle namespaces after
its `namespace_idle_expiry_s` (at least 60 s), and a registration both keeps and recreates one."""
MAX_NAMESPACES = 4096
"""Namespaces remembered for re-registration after a master restart (least recently used go first;
a forgotten one registers again on its next use)."""

log = logging.getLogger(__name__)

REFUSALS = (AlreadyExists, FailedPrecondition, InvalidArgument, PermissionDenied, Unauthenticated)
"""A registration the master refuses for good (a live node holds the node id, a layout or protocol
mismatch, a bad auth token): retrying cannot help."""
DEREGISTER_TIMEOUT_S = 1.0
"""At most this long on stop telling the master the node leaves (never blocks shutdown more)."""


class NodeAgent:
    """Registers `node` (a dict of NodeEndpoint fields) and heartbeats every interval in a thread.

    `load_fn` returns the node's current load (a dict of NodeLoad fields) for each heartbeat;
    `on_heartbeat` runs after each successful one (e.g. to flush local-tier events); `on_reconnect` after
    the first successful one of a master outage or a re-registration (e.g. to probe the pool); `on_flush_epoch` with
    each answer's flush epoch (it moves when a namespace is invalidated). `start()` raises the
    master's refusal of the first registration; a refused re-registration (`REFUSALS`: e.g. another live
    node took this node id while the master was restarting) or a refused heartbeat (its join token was
    revoked) stops heartbeating and calls `on_fatal(message)`.
    """

    def __init__(
        self,
        master: Any,
        *,
        node_id: str,
        role: str,
        grpc_address: str,
        layout_fingerprint: str,
        load_fn: Callable[[], dict[str, Any]] | None = None,
        on_heartbeat: Callable[[int], None] | None = None,
        on_reconnect: Callable[[], None] | None = None,
        on_fatal: Callable[[str], None] | None = None,
        on_flush_epoch: Callable[[int], None] | None = None,
        url: str = "",
        engine_namespace: Any = None,
    ) -> None:
        self.master = master
        self.url = url  # a vLLM engine's OpenAI base URL (the router sends it requests)
        self.engine_namespace = engine_namespace  # a vLLM engine's kvpool.client.EngineNamespace
        self.node_id = node_id
        self.role = role
        self.grpc_address = grpc_address
        self.layout_fingerprint = layout_fingerprint
        self.epoch = secrets.randbits(63) or 1
        self.load_fn = load_fn
        self.on_heartbeat = on_heartbeat
        self.on_reconnect = on_reconnect
        self.on_fatal = on_fatal
        self.on_flush_epoch = on_flush_epoch
        self.heartbeat_interval_s = 1.0
        self._namespaces: OrderedDict[NamespaceId, Namespace] = OrderedDict()
        self._registered_at: dict[NamespaceId, float] = {}  # digest -> time.monotonic() of its registration
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._registered = False  # the master accepted this epoch once: deregister on stop

    def register(self) -> None:
        """Register the node (raises the master's refusal), then every namespace it uses."""
        self._register_node()
        self._register_namespaces()

    def _register_node(self) -> None:
        from kvpool.client import NodeInfo
        from kvpool.rpc import PROTOCOL_VERSION

        node = NodeInfo(
            self.node_id, self.role, self.grpc_address, "", self.epoch, self.url, self.engine_namespace
        )
        resp = self.master.register_node(
            node, protocol_version=PROTOCOL_VERSION, layout_fingerprint=self.layout_fingerprint
        )
        interval_ms = getattr(resp, "heartbeat_interval_ms", 0) or 1000
        self.heartbeat_interval_s = interval_ms / 1000.0
        self._registered = True

    def _register_namespaces(self) -> None:
        with self._lock:
            namespaces = list(self._namespaces.values())
        for ns in namespaces:
            self._register_namespace(ns)

    def namespace(self, ns: Namespace) -> NamespaceId:
        """Register `ns` with the master on first use and again every `NAMESPACE_REFRESH_S` while it is
        used (the master expires idle namespaces); return its digest (checked against the master's)."""
        digest = ns.digest()
        now = time.monotonic()
        with self._lock:
            known = digest in self._namespaces
            fresh = known and now - self._registered_at.get(digest, now) < NAMESPACE_REFRESH_S
            if fresh:
                self._namespaces.move_to_end(digest)
        if not fresh:
            try:
                remote = self._register_namespace(ns)
            except Exception as exc:
                if not known:
                    raise
                log.debug("refreshing namespace %s failed (%s): retried in 5 s", digest.hex(), exc)
                with self._lock:  # not on every use while the master is down
                    self._registered_at[digest] = now - NAMESPACE_REFRESH_S + 5.0
                return digest
            if remote != digest:
                raise RuntimeError("the master computed another namespace digest: hashing versions differ")
            with self._lock:
                self._namespaces[digest] = ns
                self._namespaces.move_to_end(digest)
                self._registered_at[digest] = now
                while len(self._namespaces) > MAX_NAMESPACES:
                    old, _ = self._namespaces.popitem(last=False)
                    self._registered_at.pop(old, None)
        return digest

    def _register_namespace(self, ns: Namespace) -> bytes:
        extra = dict(ns.extra) if ns.extra else None
        digest, _active = self.master.register_namespace(
            ns.model_id,
            ns.weights_version,
            ns.layout.fingerprint(),
            cache_salt=ns.cache_salt,
            adapter_digest=ns.adapter_digest,
            extra=extra,
        )
        return bytes(digest)

    def known(self, digest: bytes) -> bool:
        """Whether namespace `digest` was registered with the master through this agent."""
        with self._lock:
            return digest in self._namespaces

    def forget_namespaces(self) -> None:
        with self._lock:
            self._namespaces.clear()
            self._registered_at.clear()

    def start(self, *, require_master: bool = True) -> None:
        """Register, then heartbeat in a thread. Raises the master's refusal (`REFUSALS`) of the first
        registration; an unreachable master raises too, unless `require_master` is False: then the agent
        heartbeats anyway and registers when the master first answers (a serving engine starts without it)."""
        try:
            self.register()
        except REFUSALS:
            raise
        except Exception as exc:
            if require_master:
                raise
            log.warning(
                "master unreachable (%s): %s starts without the pool and registers when it answers",
                exc,
                self.node_id,
            )
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.node_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop heartbeating, then deregister once (best effort, one short try): the master, and so the
        router, drop the node now instead of after its heartbeat timeout."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._registered:
            self._registered = False
            try:
                self.master.deregister_node(self.node_id, self.epoch, timeout_s=DEREGISTER_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - never block shutdown; it expires instead
                log.warning("could not deregister %s from the master: %s", self.node_id, exc)

    def _run(self) -> None:
        failing = False  # one warning per outage, not one per heartbeat
        while not self._stop.wait(self.heartbeat_interval_s):
            try:
                from kvpool.client import NodeLoad

                load = NodeLoad(**self.load_fn()) if self.load_fn else None
                try:
                    answer = self.master.heartbeat(self.node_id, self.epoch, load=load)
                except (PermissionDenied, Unauthenticated) as exc:  # e.g. its join token was revoked
                    log.error("the master refused %s node %s: %s", self.role, self.node_id, exc)
                    self._registered = False
                    if self.on_fatal is not None:
                        self.on_fatal(f"{type(exc).__name__}: {exc}")
                    return
                if self.on_flush_epoch is not None:
                    self.on_flush_epoch(answer.flush_epoch)
                if not answer.known:
                    log.warning("master does not know %s (restarted?): re-registering", self.node_id)
                    try:
                        self._register_node()
                    except REFUSALS as exc:
                        log.error("the master refused %s node %s: %s", self.role, self.node_id, exc)
                        if self.on_fatal is not None:
                            self.on_fatal(f"{type(exc).__name__}: {exc}")
                        return
                    self._register_namespaces()
                if self.on_heartbeat is not None:
                    self.on_heartbeat(self.epoch)
                if (failing or not answer.known) and self.on_reconnect is not None:
                    self.on_reconnect()
                if failing:
                    log.warning("heartbeats of %s reach the master again", self.node_id)
                    failing = False
            except Exception as exc:  # noqa: BLE001 - keep heartbeating through master outages
                if not failing:
                    log.warning(
                        "heartbeat failed: %s (retrying every %.1fs; quiet until it answers)",
                        exc,
                        self.heartbeat_interval_s,
                    )
                else:
                    log.debug("heartbeat failed: %s", exc)
                failing = True
