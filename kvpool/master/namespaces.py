"""Namespaces and model versions: one active weights version per model id (field case B28).

A namespace is *active* when its weights version is its model's active version. Matches under an
inactive namespace find nothing; reserves and commits under one are refused with `VersionFenced`.
Invalidating a namespace flushes it (its blocks become unreachable at once); an active one starts again
empty, and `flush_epoch` counts the flushes (and the version switches that fence namespaces) so serving
nodes drop their local tiers too.

Bounded (settings in `MasterSettings`): at most `max_namespaces` records, `max_namespaces_per_tenant`
per tenant (the cache salt's part before the first "/", `kvpool.tenants.tenant_salt`) and `max_models`
model ids; past a cap `register` raises `ResourceExhausted` naming the setting. A namespace not
registered or matched for `namespace_idle_expiry_s` and holding no blocks is forgotten by `expire`
(maintenance); registering its digest again simply recreates it. The active version of a model outlives
its namespaces: a model's record is dropped only to admit a new model id at the `max_models` cap, and only
when it has no namespaces left and its version was never set by `SetModelVersion`. Every operation is
O(1) but `set_version` and `refresh_models` (O(the models' namespaces)) and `expire` (O(records it looks at)).

Adapters (`kvpool.master.adapters`): a namespace whose adapter digest is fenced for its model (the
digest a reload or unload replaced) is inactive too; `refresh_models` turns such a change into the digests
made inactive and active, counting a flush as `set_version` does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvpool.errors import InvalidArgument, NotFound, ResourceExhausted
from kvpool.hashing import Namespace
from kvpool.master.adapters import AdapterRegistry
from kvpool.tenants import tenant_salt
from kvpool.types import KVLayout, NamespaceId

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    digest: NamespaceId
    model_id: str
    weights_version: str
    tenant: str = ""
    """The tenant's salt (`tenant_salt(cache_salt)`)."""
    adapter_digest: str = ""
    """The adapter's content digest ("" for the base model)."""


@dataclass(frozen=True, slots=True)
class NamespaceLimits:
    """Caps and expiry; the defaults are `MasterSettings`'."""

    max_namespaces: int = 100_000
    max_namespaces_per_tenant: int = 25_000
    max_models: int = 10_000
    idle_expiry_ms: int = 600_000
    max_adapters: int = 10_000


class NamespaceRegistry:
    """Not thread-safe: the master calls it under its lock. Times are the master clock's ms."""

    def __init__(self, layout: KVLayout, limits: NamespaceLimits | None = None) -> None:
        self._layout = layout
        self.limits = limits or NamespaceLimits()
        self._records: dict[bytes, NamespaceRecord] = {}
        self._last_used: OrderedDict[bytes, int] = OrderedDict()  # digest -> ms, least recent first
        self._by_model: dict[str, set[bytes]] = {}  # model id -> its digests (only non-empty sets)
        self._per_tenant: dict[str, int] = {}  # tenant salt -> its records (only > 0)
        self._active: dict[str, str] = {}  # model id -> active weights version
        self._explicit: set[str] = set()  # model ids whose version SetModelVersion set
        self._idle_models: OrderedDict[str, None] = OrderedDict()  # implicit, no namespaces left
        self.flush_epoch = 0  # invalidations so far (heartbeat answers carry it)
        self.num_expired = 0
        """Namespaces forgotten for idleness so far (a metric)."""
        self.adapters = AdapterRegistry(self.limits.max_adapters)
        """Adapter names and fenced adapter digests (`kvpool.master.adapters`): a namespace whose adapter
        digest is fenced for its model is inactive, as one of another weights version is."""

    def __len__(self) -> int:
        return len(self._records)

    def register(
        self,
        *,
        model_id: str,
        weights_version: str,
        layout_fingerprint: str,
        cache_salt: str,
        adapter_digest: str,
        extra: dict[str, str],
        now_ms: int = 0,
    ) -> tuple[NamespaceRecord, bool]:
        """Record a namespace; the model's first registered version becomes active.

        Returns (record, newly_active): `newly_active` when this call made a digest reachable.
        Raises `InvalidArgument` on an empty model id/version or a layout other than the pool's, and
        `ResourceExhausted` (naming the setting) past `max_namespaces`, `max_namespaces_per_tenant` or
        `max_models`.
        """
        if layout_fingerprint and layout_fingerprint != self._layout.fingerprint():
            raise InvalidArgument(
                f"layout {layout_fingerprint!r} differs from the pool's {self._layout.fingerprint()!r}"
            )
        try:
            ns = Namespace(
                model_id=model_id,
                weights_version=weights_version,
                layout=self._layout,
                cache_salt=cache_salt,
                adapter_digest=adapter_digest,
                extra=tuple(sorted(extra.items())),
            )
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        digest = ns.digest()
        known = self._records.get(digest)
        if known is not None:
            self.touch(digest, now_ms)
            return known, False
        tenant = tenant_salt(cache_salt)
        lim = self.limits
        if len(self._records) >= lim.max_namespaces:
            raise ResourceExhausted(
                f"{len(self._records)} namespaces registered: the master's max_namespaces is "
                f"{lim.max_namespaces} (idle ones expire after namespace_idle_expiry_s)"
            )
        if self._per_tenant.get(tenant, 0) >= lim.max_namespaces_per_tenant:
            raise ResourceExhausted(
                f"the tenant has {lim.max_namespaces_per_tenant} namespaces: the master's "
                "max_namespaces_per_tenant (idle ones expire after namespace_idle_expiry_s)"
            )
        self._admit_model(model_id)
        record = NamespaceRecord(digest, model_id, weights_version, tenant, adapter_digest)
        self._records[digest] = record
        self._last_used[digest] = now_ms
        self._by_model.setdefault(model_id, set()).add(digest)
        self._idle_models.pop(model_id, None)
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        self._active.setdefault(model_id, weights_version)
        return record, self.is_active(digest)

    def touch(self, digest: bytes, now_ms: int) -> None:
        """A namespace was used (registered or matched): O(1); unknown digests are ignored."""
        last = self._last_used
        if digest in last:
            last[digest] = now_ms
            last.move_to_end(digest)

    def active_version(self, model_id: str) -> str:
        return self._active.get(model_id, "")

    def is_active(self, digest: bytes) -> bool:
        record = self._records.get(digest)
        if record is None:
            return False
        if self._active.get(record.model_id) != record.weights_version:
            return False
        return not self.adapters.is_fenced(record.model_id, record.adapter_digest)

    def is_known(self, digest: bytes) -> bool:
        return digest in self._records

    def tenant_of(self, digest: bytes) -> str | None:
        record = self._records.get(digest)
        return None if record is None else record.tenant

    def set_version(self, model_id: str, weights_version: str) -> tuple[str, list[bytes], list[bytes]]:
        """Activate `weights_version` of `model_id`; when that makes namespaces inactive it counts a
        flush (`flush_epoch`), as `invalidate` does.

        Returns (previous version, digests made inactive, digests made active).
        """
        if not model_id or not weights_version:
            raise InvalidArgument("model_id and weights_version must be non-empty")
        self._admit_model(model_id)
        previous = self._active.get(model_id, "")
        mine = self._by_model.get(model_id, set())
        was_active = {d for d in mine if self.is_active(d)}
        self._active[model_id] = weights_version
        self._explicit.add(model_id)
        self._idle_models.pop(model_id, None)
        now_active = {d for d in mine if self.is_active(d)}
        off = sorted(was_active - now_active)
        if off:  # unreachable now: serving nodes drop their local tiers too
            self.flush_epoch += 1
        return previous, off, sorted(now_active - was_active)

    def refresh_models(
        self, model_ids: set[str], change: Callable[[], T]
    ) -> tuple[T, list[bytes], list[bytes]]:
        """Run `change()` (e.g. an adapter fenced) and return (its result, digests of `model_ids` it made
        inactive, digests it made active); inactive ones count a flush (`flush_epoch`), as `set_version`.
        O(those models' namespaces)."""
        mine = [d for m in model_ids for d in self._by_model.get(m, ())]
        was_active = {d for d in mine if self.is_active(d)}
        result = change()
        now_active = {d for d in mine if self.is_active(d)}
        off = sorted(was_active - now_active)
        if off:  # unreachable now: serving nodes drop their local tiers too
            self.flush_epoch += 1
        return result, off, sorted(now_active - was_active)

    def of_model(self, model_id: str) -> list[NamespaceRecord]:
        """The model's namespace records: O(its namespaces)."""
        return [self._records[d] for d in self._by_model.get(model_id, ())]

    def invalidate(self, digest: bytes) -> None:
        """Count a flush of one namespace (the caller drops its blocks); `NotFound` if unknown."""
        if digest not in self._records:
            raise NotFound(f"unknown namespace {digest.hex()}")
        self.flush_epoch += 1

    def expire(
        self, now_ms: int, in_use: Callable[[bytes], bool], limit: int = 10_000
    ) -> list[NamespaceRecord]:
        """Forget up to `limit` namespaces idle for `idle_expiry_ms`; `in_use(digest)` (blocks in the
        pool, open reservations) keeps one for another period. Returns the forgotten records."""
        last, out = self._last_used, list[NamespaceRecord]()
        cutoff = now_ms - self.limits.idle_expiry_ms
        for _ in range(min(limit, len(last))):
            digest, used_ms = next(iter(last.items()))
            if used_ms > cutoff:
                break
            if in_use(digest):
                self.touch(digest, now_ms)
                continue
            out.append(self._forget(digest))
        self.num_expired += len(out)
        return out

    def records(self) -> list[NamespaceRecord]:
        return list(self._records.values())

    @property
    def num_models(self) -> int:
        return len(self._active)

    def _forget(self, digest: bytes) -> NamespaceRecord:
        record = self._records.pop(digest)
        del self._last_used[digest]
        mine = self._by_model[record.model_id]
        mine.discard(digest)
        if not mine:
            del self._by_model[record.model_id]
            if record.model_id not in self._explicit:
                self._idle_models[record.model_id] = None
        n = self._per_tenant[record.tenant] - 1
        if n:
            self._per_tenant[record.tenant] = n
        else:
            del self._per_tenant[record.tenant]
        return record

    def _admit_model(self, model_id: str) -> None:
        """Make room for a new model id's record at the `max_models` cap, or raise `ResourceExhausted`."""
        if model_id in self._active or len(self._active) < self.limits.max_models:
            return
        if not self._idle_models:
            raise ResourceExhausted(
                f"{len(self._active)} model ids known: the master's max_models is {self.limits.max_models}"
            )
        old, _ = self._idle_models.popitem(last=False)
        del self._active[old]
