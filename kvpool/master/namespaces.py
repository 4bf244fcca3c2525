"""Namespaces and model versions: one active weights version per model id (field case B28).

A namespace is *active* when its weights version is its model's active version. Matches under an
inactive namespace find nothing; reserves and commits under one are refused with `VersionFenced`.
Invalidating a namespace flushes it (its blocks become unreachable at once); an active one starts again
empty, and `flush_epoch` counts the flushes so serving nodes drop their local tiers too.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import InvalidArgument, NotFound
from kvpool.hashing import Namespace
from kvpool.types import KVLayout, NamespaceId


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    digest: NamespaceId
    model_id: str
    weights_version: str


class NamespaceRegistry:
    """Not thread-safe: the master calls it under its lock."""

    def __init__(self, layout: KVLayout) -> None:
        self._layout = layout
        self._records: dict[bytes, NamespaceRecord] = {}
        self._active: dict[str, str] = {}  # model id -> active weights version
        self.flush_epoch = 0  # invalidations so far (heartbeat answers carry it)

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
    ) -> tuple[NamespaceRecord, bool]:
        """Record a namespace; the model's first registered version becomes active.

        Returns (record, newly_active): `newly_active` when this call made a digest reachable.
        Raises `InvalidArgument` on an empty model id/version or a layout other than the pool's.
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
        known = digest in self._records
        record = NamespaceRecord(digest, model_id, weights_version)
        self._records[digest] = record
        self._active.setdefault(model_id, weights_version)
        return record, (not known and self.is_active(digest))

    def active_version(self, model_id: str) -> str:
        return self._active.get(model_id, "")

    def is_active(self, digest: bytes) -> bool:
        record = self._records.get(digest)
        if record is None:
            return False
        return self._active.get(record.model_id) == record.weights_version

    def is_known(self, digest: bytes) -> bool:
        return digest in self._records

    def set_version(self, model_id: str, weights_version: str) -> tuple[str, list[bytes], list[bytes]]:
        """Activate `weights_version` of `model_id`.

        Returns (previous version, digests made inactive, digests made active).
        """
        if not model_id or not weights_version:
            raise InvalidArgument("model_id and weights_version must be non-empty")
        previous = self._active.get(model_id, "")
        mine = [d for d, r in self._records.items() if r.model_id == model_id]
        was_active = {d for d in mine if self.is_active(d)}
        self._active[model_id] = weights_version
        now_active = {d for d in mine if self.is_active(d)}
        return previous, sorted(was_active - now_active), sorted(now_active - was_active)

    def invalidate(self, digest: bytes) -> None:
        """Count a flush of one namespace (the caller drops its blocks); `NotFound` if unknown."""
        if digest not in self._records:
            raise NotFound(f"unknown namespace {digest.hex()}")
        self.flush_epoch += 1

    def records(self) -> list[NamespaceRecord]:
        return list(self._records.values())
