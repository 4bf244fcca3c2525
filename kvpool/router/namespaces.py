"""The router's namespace digests, one per cache salt, in a bounded LRU (bounded state).

Every request hashes its prompt in its namespace (`kvpool.hashing.Namespace`: model, weights, layout and
cache salt), whose digest the router registers with the master the first time it sees the salt. A
client may send a new `cache_salt` with every request, so the digests are kept for at most
`RouterSettings.namespace_cache_size` salts, least recently used first out. Dropping one only costs its
recomputation (microseconds) and one more `RegisterNamespace` (idempotent on the master) on the salt's
next request: no request is refused for the router's own cap, and a lookup is O(1) whatever the number
of salts.

The master has caps of its own on namespaces; when it refuses a new one with RESOURCE_EXHAUSTED the
request is answered `ResourceExhausted` (HTTP 429) with the master's message, which names its setting.
Any other registration failure (the master down, say) is logged and the request is routed without
caching the digest, as before.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvpool.errors import KVPoolError, ResourceExhausted

log = logging.getLogger(__name__)


class NamespaceCache:
    """Thread-safe LRU of namespace digests (bytes) by cache salt, at most `capacity` entries."""

    def __init__(
        self, model: Any, master: Any, capacity: int, *, on_evict: Callable[[], None] | None = None
    ) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.model = model
        self.master = master
        self.capacity = capacity
        self.evictions = 0
        """Entries dropped for the cap since start (count); `on_evict` is called for each."""
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._digests: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._digests)

    def get(self, cache_salt: str) -> bytes:
        """The namespace digest of `cache_salt`, registered with the master on first use (or after its
        entry was evicted). `ResourceExhausted` when the master refuses a new namespace for a cap."""
        with self._lock:
            ns = self._digests.get(cache_salt)
            if ns is not None:
                self._digests.move_to_end(cache_salt)
                return ns
        ns = self._register(cache_salt)
        if ns is None:
            return bytes(self.model.namespace(cache_salt).digest())  # not cached: asked again next time
        with self._lock:
            self._digests[cache_salt] = ns
            self._digests.move_to_end(cache_salt)
            dropped = 0
            while len(self._digests) > self.capacity:
                self._digests.popitem(last=False)
                dropped += 1
            self.evictions += dropped
        if self._on_evict is not None:
            for _ in range(dropped):
                self._on_evict()
        return ns

    def _register(self, cache_salt: str) -> bytes | None:
        """Our digest once the master registered it; None when the registration failed (logged)."""
        info = self.model.namespace(cache_salt)
        ns = bytes(info.digest())
        try:
            remote, active = self.master.register_namespace(
                info.model_id, info.weights_version, info.layout.fingerprint(), cache_salt=cache_salt
            )
        except ResourceExhausted as exc:
            raise ResourceExhausted(
                f"the master refuses a new namespace for this cache salt: {exc}"
            ) from None
        except KVPoolError as exc:
            log.warning("register_namespace failed (%s); peeks may miss", exc)
            return None
        if active and active != info.weights_version:
            log.warning(
                "master's active version of %s is %s, ours %s", info.model_id, active, info.weights_version
            )
        if bytes(remote) != ns:
            log.warning("master computed another namespace digest: hashing versions differ")
        return ns
