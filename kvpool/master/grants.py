"""The data-plane capabilities the master grants with its answers (format: kvpool/capability.py).

A leased match grants a read capability per store replica until the lease ends; a reservation grants a
write capability per reserved slot until its write lease ends; a re-replication copy grants the
destination store a read capability for the source replica. Peeks (no lease) grant nothing. Each
capability is bound to the store node, slot and generation of that replica and to the block (namespace,
hash) the store recorded for the slot, so it is useless for any other block, replica or operation.
Cost: one HMAC-SHA256 (~1 µs) per replica.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.capability import READ, WRITE, Capabilities
from kvpool.index.results import MatchResult
from kvpool.types import Location


def match_grants(
    caps: Capabilities,
    ns: bytes,
    hashes: Sequence[bytes],
    res: MatchResult,
    lease_ttl_ms: int,
    epoch: int = 0,
) -> tuple[list[bytes], int]:
    """Read capabilities, one per replica in the packed order (block by block, each block's replicas in
    order; b"" for node-local copies), and their common expiry (wall-clock ms). `epoch`: the leader epoch
    they are bound to (0: a single master; kvpool.capability.EPOCH_NBYTES)."""
    expiry = caps.expiry(lease_ttl_ms)
    sign = caps.signer(READ, ns, expiry, epoch)
    if res.extra:
        flat = [
            (hashes[i], loc.node_id, loc.slot, loc.generation, loc.local)
            for i, locs in enumerate(res.locations)
            for loc in locs
        ]
        return [b"" if lo else sign(n, h, s, g) for h, n, s, g, lo in flat], expiry
    names = res.node_ids
    columns = zip(
        hashes[: res.num_matched],
        [names[k] for k in res.replica_node.tolist()],
        res.replica_slot.tolist(),
        res.replica_generation.tolist(),
        res.replica_local.tolist(),
        strict=True,
    )
    return [b"" if lo else sign(n, h, s, g) for h, n, s, g, lo in columns], expiry


def write_grants(
    caps: Capabilities,
    ns: bytes,
    hashes: Sequence[bytes],
    locations: Sequence[Sequence[Location]],
    ttl_ms: int,
    epoch: int = 0,
) -> list[list[Location]]:
    """`locations[i]` (the slots reserved for `hashes[i]`) with a write capability each (bound to the
    leader `epoch`, 0 for a single master)."""
    expiry = caps.expiry(ttl_ms)
    sign = caps.signer(WRITE, ns, expiry, epoch)
    return [
        [
            Location(
                x.node_id, x.slot, x.generation, x.local, sign(x.node_id, h, x.slot, x.generation), expiry
            )
            for x in locs
        ]
        for h, locs in zip(hashes, locations, strict=True)
    ]


def read_grant(
    caps: Capabilities | None, ns: bytes, block_hash: bytes, loc: Location, ttl_ms: int, epoch: int = 0
) -> Location:
    """`loc` with a read capability for `ttl_ms` bound to the leader `epoch` (unchanged when capabilities
    are off)."""
    if caps is None:
        return loc
    expiry = caps.expiry(ttl_ms)
    cap = caps.sign(READ, ns, block_hash, loc.node_id, loc.slot, loc.generation, expiry, epoch)
    return Location(loc.node_id, loc.slot, loc.generation, loc.local, cap, expiry)
