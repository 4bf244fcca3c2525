"""Adapters are content; reloading one is an operation (field case B01).

A namespace's adapter field is the adapter's content digest (`kvpool.hashing.check_adapter_digest`),
never its name: engines derive it from the adapter's files (`kvpool.vllm.identity.directory_digest`), so
new weights are a new namespace by construction. The registry here adds the *operation*: an operator
names an adapter of a model (`RegisterAdapter(model_id, name, digest)`), and `ReloadAdapter` (new
weights) or `UnloadAdapter` *fences* the digest it replaces: every namespace of the model built with that
digest becomes inactive at once, as a version switch fences another weights version (matches find
nothing, reserves and commits are refused with `VersionFenced`, the flush epoch moves so serving nodes drop
their node-local tiers), and the answer counts the namespaces and blocks made unreachable. A digest still
named by another adapter of the model stays served; registering or reloading to a fenced digest serves it
again (empty: its blocks were dropped at the fence).

Bounded: at most `max_adapters` names (all models; past it `ResourceExhausted` naming the setting) and as
many fences, the oldest forgotten first: its digest may then serve again, which is safe, since KV under a
content digest is always that content's KV.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from kvpool.hashing import check_adapter_digest
from kvpool.types import NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (model id, adapter name) or (model id, adapter digest)


@dataclass(frozen=True, slots=True)
class AdapterChange:
    """What a reload or unload did: the digest it replaced and what became unreachable."""

    previous_digest: str
    num_namespaces_invalidated: int
    num_blocks_invalidated: int


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    model_id: str
    name: str
    digest: str
    num_namespaces: int
    """Registered namespaces of the model built with `digest`."""
    num_blocks: int
    """Their blocks in the pool."""


class AdapterRegistry:
    """Names and fences; not thread-safe (the master calls it under its lock, inside
    `NamespaceRegistry.refresh_models`, which turns fences into inactive namespaces). O(1) per call."""

    def __init__(self, max_adapters: int) -> None:
        self.max_adapters = max_adapters
        self._digest: dict[Key, str] = {}  # (model, name) -> current digest
        self._fenced: OrderedDict[Key, None] = OrderedDict()  # (model, digest), oldest first
        self._uses: dict[Key, int] = {}  # (model, digest) -> names pointing at it (only > 0)

    def __len__(self) -> int:
        return len(self._digest)

    def is_fenced(self, model_id: str, digest: str) -> bool:
        return bool(digest) and (model_id, digest) in self._fenced

    def digest_of(self, model_id: str, name: str) -> str:
        digest = self._digest.get((model_id, name))
        if digest is None:
            raise NotFound(f"no adapter {name!r} of model {model_id!r} is registered")
        return digest

    def entries(self) -> list[tuple[str, str, str]]:
        """(model id, name, digest) of every registered adapter, sorted."""
        return sorted((m, n, d) for (m, n), d in self._digest.items())

    def next_forgotten(self) -> str | None:
        """The model whose oldest fence one more fence would forget (None: none would be)."""
        if len(self._fenced) < self.max_adapters:
            return None
        return next(iter(self._fenced))[0]

    def register(self, model_id: str, name: str, digest: str) -> bool:
        """Name `digest`; True when new, False when already so named. `AlreadyExists` when the name has
        another digest (that is a reload), `ResourceExhausted` past `max_adapters`."""
        known = self._digest.get((model_id, name))
        if known == digest:
            return False
        if known is not None:
            raise AlreadyExists(
                f"adapter {name!r} of model {model_id!r} is registered with digest {known}: "
                "reload it (ReloadAdapter, kvpool admin adapter reload) to change its weights"
            )
        if len(self._digest) >= self.max_adapters:
            raise ResourceExhausted(
                f"{len(self._digest)} adapters registered: the master's max_adapters is {self.max_adapters} "
                "(unload one first)"
            )
        self._point((model_id, name), digest)
        return True

    def reload(self, model_id: str, name: str, digest: str) -> str:
        """Point `name` at `digest`, fencing the previous digest unless another name uses it; returns
        the previous digest. `NotFound` when the name is not registered."""
        previous = self.digest_of(model_id, name)
        if previous != digest:
            self._unpoint(model_id, previous)
            self._point((model_id, name), digest)
        return previous

    def unload(self, model_id: str, name: str) -> str:
        """Forget `name`, fencing its digest unless another name uses it; returns that digest."""
        previous = self.digest_of(model_id, name)
        del self._digest[(model_id, name)]
        self._unpoint(model_id, previous)
        return previous

    def _point(self, key: Key, digest: str) -> None:
        self._digest[key] = digest
        used = (key[0], digest)
        self._uses[used] = self._uses.get(used, 0) + 1
        self._fenced.pop(used, None)  # named again: served again

    def _unpoint(self, model_id: str, digest: str) -> None:
        used = (model_id, digest)
        n = self._uses[used] - 1
        if n:
            self._uses[used] = n
            return
        del self._uses[used]
        while len(self._fenced) >= self.max_adapters:
            self._fenced.popitem(last=False)
        self._fenced[used] = None


def _check(model_id: str, name: str) -> None:
    if not model_id or not name:
        raise InvalidArgument("model_id and name must be non-empty")


def _digest(digest: str) -> str:
    try:
        return check_adapter_digest(digest, "digest", allow_empty=False)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def _apply(m: Master, model_id: str, change: Callable[[], str], what: str) -> AdapterChange:
    """Under the lock: run a registry change and make what it fenced unreachable (index, reservations,
    node-local tiers through the flush epoch) and what it unfenced reachable (empty)."""
    ns = m.namespaces
    models = {model_id}
    forgotten = ns.adapters.next_forgotten()
    if forgotten is not None:
        models.add(forgotten)
    previous, off, on = ns.refresh_models(models, change)
    blocks = sum(m.index.num_blocks_in(NamespaceId(d)) for d in off)
    for digest in off:
        m.index.invalidate_namespace(NamespaceId(digest))
        m.publisher.flush(digest)
    for digest in on:
        m.index.register_namespace(NamespaceId(digest), m.quotas.group(ns.tenant_of(digest)))
    m.wake.set()
    log.info("model %s: adapter %s (%d namespaces, %d blocks unreachable)", model_id, what, len(off), blocks)
    return AdapterChange(previous, len(off), blocks)


def register_adapter(m: Master, model_id: str, name: str, digest: str) -> bool:
    """Name an adapter of a model by its content digest; True when new. A fenced digest serves again."""
    _check(model_id, name)
    digest = _digest(digest)
    with m.lock:
        adapters, created = m.namespaces.adapters, [False]

        def change() -> str:
            created[0] = adapters.register(model_id, name, digest)
            return ""

        _apply(m, model_id, change, f"{name!r} registered as {digest}")
        return created[0]


def reload_adapter(m: Master, model_id: str, name: str, digest: str) -> AdapterChange:
    """New weights for a named adapter: its previous digest's KV is unreachable at once (see the module)."""
    _check(model_id, name)
    digest = _digest(digest)
    with m.lock:
        adapters = m.namespaces.adapters
        return _apply(
            m, model_id, lambda: adapters.reload(model_id, name, digest), f"{name!r} reloaded as {digest}"
        )


def unload_adapter(m: Master, model_id: str, name: str) -> AdapterChange:
    """Forget a named adapter: its digest's KV is unreachable at once unless another name uses it."""
    _check(model_id, name)
    with m.lock:
        adapters = m.namespaces.adapters
        return _apply(m, model_id, lambda: adapters.unload(model_id, name), f"{name!r} unloaded")


def list_adapters(m: Master, model_id: str = "") -> list[AdapterInfo]:
    """Registered adapters (of `model_id`, or all), with the namespaces and blocks under each digest.
    O(adapters + the listed models' namespaces): an admin call."""
    with m.lock:
        entries = [e for e in m.namespaces.adapters.entries() if not model_id or e[0] == model_id]
        per: dict[Key, list[int]] = {}
        for model in {e[0] for e in entries}:
            for r in m.namespaces.of_model(model):
                if r.adapter_digest:
                    count = per.setdefault((model, r.adapter_digest), [0, 0])
                    count[0] += 1
                    count[1] += m.index.num_blocks_in(r.digest)
        return [AdapterInfo(mo, n, d, *per.get((mo, d), [0, 0])) for mo, n, d in entries]
