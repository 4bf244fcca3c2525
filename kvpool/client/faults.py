"""Which failed reads prove a replica bad (and are reported to the master) and which do not."""

from __future__ import annotations

# Errors that prove the replica itself is bad (its bytes, its slot, its generation). A timeout or a refused
# connection may be this reader's own network: reporting those would let one broken reader strip the pool
# of replicas every other node can read, so they are only retried; the master learns of dead nodes from
# missed heartbeats.
_REPLICA_FAULTS = ("checksum mismatch", "StaleGeneration", "FailedPrecondition", "NotFound", "LeaseExpired",
                   "ChecksumMismatch", "InvalidArgument")  # fmt: skip


def is_replica_fault(error: str) -> bool:
    """True when a failed read's error says the replica is bad (not merely unreachable from here)."""
    return any(marker in error for marker in _REPLICA_FAULTS)
