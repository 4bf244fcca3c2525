"""One exception hierarchy for the whole project; `kvpool.rpc.status` maps each to one gRPC status.

Never return error codes: raise one of these.
"""

from __future__ import annotations


class KVPoolError(Exception):
    """Base of every kvpool error."""


class InvalidArgument(KVPoolError, ValueError):
    """The caller sent something malformed (wrong hash length, negative size, bad token id...)."""


class NotFound(KVPoolError, LookupError):
    """An unknown node, slot, lease, namespace or block."""


class AlreadyExists(KVPoolError):
    """The thing exists already and the operation does not allow that."""


class FailedPrecondition(KVPoolError):
    """The system is not in a state that allows the operation (layout mismatch, stale epoch...)."""


class StaleGeneration(FailedPrecondition):
    """A read or write named a slot generation that is no longer current."""


class LeaseExpired(FailedPrecondition):
    """A lease (read or write) ended before the operation completed."""


class VersionFenced(FailedPrecondition):
    """A write for a namespace whose model version is no longer active."""


class Unauthenticated(KVPoolError, PermissionError):
    """The caller did not present valid credentials (bearer token) where authentication is on."""


class PermissionDenied(KVPoolError, PermissionError):
    """The credential does not allow the operation: a data-plane capability missing, forged, for another
    slot, generation, block or operation, or expired (`kvpool.capability`)."""


class ResourceExhausted(KVPoolError):
    """No capacity (no evictable slot, queue full, batch too large)."""


class DeadlineExceeded(KVPoolError, TimeoutError):
    """An operation did not finish within its deadline."""


class Unavailable(KVPoolError, ConnectionError):
    """A peer (master, store node) cannot be reached."""


class TransferError(KVPoolError):
    """Moving one block's bytes failed (peer died, timeout, refused). Per block, never a hang."""


class ChecksumMismatch(TransferError):
    """A block's bytes did not match its recorded checksum."""
