"""Moving block bytes between nodes: the `Transport` protocol and its UCX and loopback implementations.

Depends on nothing in the project. `UcxTransport`/`UcxBlockServer` import `ucxx` only when first used.
"""

from transfer.base import (
    BlockHandler,
    BlockRead,
    BlockResult,
    BlockServer,
    BlockWrite,
    LinkEstimate,
    PeerLost,
    TransferError,
    TransferTimedOut,
    Transport,
)
from transfer.loopback import LoopbackBlockServer, LoopbackTransport
from transfer.ucx import UCX_ENV_DEFAULTS, UcxBlockServer, UcxTransport, apply_ucx_env_defaults, ucx_available
from transfer.xxh3 import checksum, checksums

__all__ = [
    "UCX_ENV_DEFAULTS",
    "BlockHandler",
    "BlockRead",
    "BlockResult",
    "BlockServer",
    "BlockWrite",
    "LinkEstimate",
    "LoopbackBlockServer",
    "LoopbackTransport",
    "PeerLost",
    "TransferError",
    "TransferTimedOut",
    "Transport",
    "UcxBlockServer",
    "UcxTransport",
    "apply_ucx_env_defaults",
    "checksum",
    "checksums",
    "ucx_available",
]
