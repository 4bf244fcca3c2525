"""What the connector calls on its collaborators: the master link, the pool client and the transport.

`kvpool.client.MasterClient`, `kvpool.client.PoolClient` and `transfer.Transport` implementations satisfy
these Protocols; so do the vLLM scheduler half's `ReportedLinks` (links the workers measured) and the
fakes of tests that cause faults no real component can.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from kvpool.client.types import PutResult
    from kvpool.cost import LinkLike
    from kvpool.types import Location, Match, NodeStatus
    from transfer import BlockRead, BlockResult


class MasterPort(Protocol):
    """The master link: match with a read lease, release it (one or a batch) and renew it, report bad
    replicas and the node-local tier's events. `list_nodes` and `close` serve the vLLM halves that share the link."""

    def match(
        self,
        namespace: bytes,
        block_hashes: Sequence[bytes],
        *,
        count_hit: bool = False,
        lease_ttl_ms: int = 0,
        num_prompt_tokens: int = 0,
        request_id: str = "",
    ) -> Match: ...

    def release_lease(self, lease_id: int) -> None: ...

    def release_leases(self, lease_ids: Sequence[int]) -> tuple[int, int]: ...

    def renew_lease(self, lease_id: int, ttl_ms: int) -> int: ...

    def report_bad_replica(
        self, namespace: bytes, block_hash: bytes, location: Location, reason: str
    ) -> None: ...

    def report_local(
        self,
        node_id: str,
        epoch: int,
        namespace: bytes = b"",
        *,
        stored: Sequence[bytes] = (),
        removed: Sequence[bytes] = (),
        cleared: bool = False,
    ) -> None: ...

    def list_nodes(self) -> list[NodeStatus]: ...

    def close(self) -> None: ...


class PoolPort(Protocol):
    """The pool client's publish: reserve → write → commit of a chain of blocks."""

    def put_blocks(
        self,
        namespace: bytes,
        parent: bytes | None,
        block_hashes: Sequence[bytes],
        blocks: Sequence[bytes | np.ndarray | memoryview],
        *,
        num_replicas: int = 0,
        recompute_cost_s: Sequence[float] = (),
        writer_node_id: str = "",
        flush_epoch: int | None = None,
    ) -> PutResult: ...

    def close(self) -> None: ...


class TransportPort(Protocol):
    """The data plane as the connector uses it: link estimates (decisions) and block reads (pulls)."""

    def link(self, peer: str) -> LinkLike: ...

    def read_blocks(
        self, peer: str, reads: Sequence[BlockRead], out: Sequence[memoryview], *, timeout_s: float
    ) -> list[BlockResult]: ...

    def close(self) -> None: ...
