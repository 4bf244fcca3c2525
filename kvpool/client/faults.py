"""Which failed reads prove a replica bad (and are reported to the master) and which do not."""

from __future__ import annotations

# Errors that prove the replica itself is bad (its bytes, its slot, its generation). A timeout or a refused
# connection may be this reader's own network: reporting those would let one broken reader strip the pool
# of replicas every other node can read, so they are only retried; the master learns of dead nodes from
# missed heartbeats.
_REPLICA_FAULTS = (
    "checksum mismatch",
    "StaleGeneration",
    "FailedPrecondition",
    "NotFound",
    "LeaseExpired",
    "ChecksumMismatch",
    "InvalidArgument",
)


def is_replica_fault(error: str) -> bool:
    """True when a failed read's error says the replica is bad (not merely unreachable from here)."""
    return any(marker in error for marker in _REPLICA_FAULTS)


def is_slow_transfer(error: str) -> bool:
    """True when a failed read only missed its own deadline while the store answered (the transport's
    `TransferTimedOut`, e.g. one pull of a convoy on a shared link, B39): the pool is reachable."""
    return "TransferTimedOut" in error


# Failed writes that are not the store's data plane failing: this writer was late (its lease or
# capability expired, the slot moved on), sent something invalid, or the peer is already being skipped
# after a failure that was reported when it happened.
_WRITER_FAULTS = (
    "LeaseExpired",
    "StaleGeneration",
    "AlreadyExists",
    "PermissionDenied",
    "InvalidArgument",
    "backing off",
)


def write_fault_kind(error: str) -> str | None:
    """The data-plane failure a failed write shows ("checksum": the store received other bytes than were
    sent; "write": refused or lost in transit), None when it is not the store's (`_WRITER_FAULTS`)."""
    if "ChecksumMismatch" in error or "checksum mismatch" in error:
        return "checksum"
    if any(marker in error for marker in _WRITER_FAULTS):
        return None
    return "write"
