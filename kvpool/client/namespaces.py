"""The namespaces a serving node uses, registered with the master and kept there (`NamespaceRegistry`).

The master forgets idle namespaces, and a master restarted from nothing knows none: the registry registers
each on first use, again every `NAMESPACE_REFRESH_S` while it is used, and all of them again whenever the
node registers anew (`kvpool.client.master_link.MasterLink` calls `register_all`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from kvpool.hashing import Namespace
from kvpool.types import NamespaceId

if TYPE_CHECKING:
    from kvpool.client.master_client import MasterClient

NAMESPACE_REFRESH_S = 60.0
"""A namespace in use is registered again after this long (s): the master forgets idle namespaces after
its `namespace_idle_expiry_s` (at least 60 s), and a registration both keeps and recreates one."""
MAX_NAMESPACES = 4096
"""Namespaces remembered for re-registration after a master restart (least recently used go first;
a forgotten one registers again on its next use)."""

log = logging.getLogger(__name__)


class NamespaceRegistry:
    """The namespaces registered with the master through `master`, least recently used first. Thread-safe."""

    def __init__(self, master: MasterClient) -> None:
        self.master = master
        self._namespaces: OrderedDict[NamespaceId, Namespace] = OrderedDict()
        self._registered_at: dict[NamespaceId, float] = {}  # digest -> time.monotonic() of its registration
        self._lock = threading.Lock()

    def namespace(self, ns: Namespace) -> NamespaceId:
        """Register `ns` with the master on first use and again every `NAMESPACE_REFRESH_S` while it is
        used (the master expires idle namespaces); return its digest (checked against the master's).
        Raises the master's error on first use (`kvpool.errors`); a failed refresh is retried in 5 s."""
        digest = ns.digest()
        now = time.monotonic()
        with self._lock:
            known = digest in self._namespaces
            fresh = known and now - self._registered_at.get(digest, now) < NAMESPACE_REFRESH_S
            if fresh:
                self._namespaces.move_to_end(digest)
        if not fresh:
            try:
                remote = self._register(ns)
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

    def register_all(self) -> None:
        """Register every namespace known here again (after the node registered anew); raises the
        master's error of the first that fails."""
        with self._lock:
            namespaces = list(self._namespaces.values())
        for ns in namespaces:
            self._register(ns)

    def _register(self, ns: Namespace) -> bytes:
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
        """Whether namespace `digest` was registered with the master through this registry."""
        with self._lock:
            return digest in self._namespaces
