"""The client's gRPC error mapping: statuses become `kvpool.errors`, FAILED_PRECONDITION refined by its text."""

from __future__ import annotations

from typing import NoReturn

import grpc

from kvpool.errors import FailedPrecondition, LeaseExpired, StaleGeneration, VersionFenced
from kvpool.rpc.status import raise_from_rpc_error

_REFINED: list[tuple[str, type[FailedPrecondition]]] = [
    ("fenced", VersionFenced),
    ("expired", LeaseExpired),
    ("generation", StaleGeneration),
]


def raise_refined(exc: grpc.RpcError, what: str) -> NoReturn:
    """Like `raise_from_rpc_error`, recovering the FAILED_PRECONDITION subclasses from the message."""
    try:
        raise_from_rpc_error(exc, what)
    except FailedPrecondition as err:
        text = str(err).lower()
        for word, cls in _REFINED:
            if word in text:
                raise cls(str(err)) from None
        raise
