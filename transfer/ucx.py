"""The UCX data plane on `ucxx`: store-mediated two-sided messaging, never one-sided RMA.

Wire protocol (per endpoint; control headers are msgpack maps sent as UCX active messages, block bytes
are tagged messages straight from/into the slot and caller buffers; tag = (request id << 20) | index):

    read   client -> {op:"read", id, b:[[slot, gen, nbytes], ...]}
           server -> {id, ph:0, r:[[ok, checksum, error], ...]}, then one tagged send per ok block
    write  client -> {op:"write", id, b:[[slot, gen, nbytes, checksum], ...]}
           server -> {id, ph:0, r:[[ok, 0, error], ...]}   (accepted blocks; their receives are posted)
           client -> one tagged send per accepted block
           server -> {id, ph:1, r:[[ok, checksum, error], ...]}   (after the checksum of what landed)
    ping   client -> {op:"ping", id}           server -> {id, ph:0}
    read and write may add c:[[expiry_ms, capability bytes], ...], one per block of b (opaque here:
    the server passes them to its `BlockHandler`, which verifies them; see kvpool/capability.py)
    bw     client -> {op:"bw", id, n}          server -> {id, ph:0}, then n bytes tagged (link probe)
    mread / mdone: a same-host reader's read through its mapping of the store's segment, whose
    descriptor the ping reply carries as `seg` (`transfer.ucx_mapped`, `transfer.shared_segment`)

Modules: `ucx_runtime` (context, loop thread, shared helpers), `ucx_server` (`UcxBlockServer`),
`ucx_client` (`UcxTransport`); this module re-exports their public names.

A connection opens with a ping handshake (see `ucx_runtime` for why: ucxx loses the first active messages
of an endpoint whose recycled handle has receives orphaned by an abort). Request ids are process-wide.

One process holds one UCX context, progressed by one asyncio loop in a daemon thread (`_Runtime`); the
sync API submits coroutines to it. UCX environment defaults, set before `ucxx` is imported unless
already set: `UCX_MM_ERROR_HANDLING=y` (else shared memory is silently unused), `UCXPY_PROGRESS_MODE=
blocking` (several times faster than the progress thread on few cores), 512 KiB tcp segments
(`UCX_TCP_TX_SEG_SIZE`/`UCX_TCP_RX_SEG_SIZE`: 2.5-4x the loopback throughput of the 8 KiB default),
`UCX_TCP_CM_REUSEADDR=y` (a listener restarted on its port while old connections sit in TIME_WAIT), and
`tcp` is appended to a user-given `UCX_TLS` that lacks it (connection establishment needs it). Idle
connections do not spin the loop thread (`ucx_wait`).
"""

from transfer.ucx_client import UcxTransport
from transfer.ucx_runtime import (
    _ABORT_PERIOD_NS,
    _INDEX_BITS,
    MAX_BLOCKS_PER_MESSAGE,
    UCX_ENV_DEFAULTS,
    _err,
    _pack,
    _Runtime,
    _tag,
    _unpack,
    apply_ucx_env_defaults,
    ucx_available,
)
from transfer.ucx_server import UcxBlockServer

__all__ = [
    "MAX_BLOCKS_PER_MESSAGE",
    "UCX_ENV_DEFAULTS",
    "_ABORT_PERIOD_NS",
    "_INDEX_BITS",
    "UcxBlockServer",
    "UcxTransport",
    "_Runtime",
    "_err",
    "_pack",
    "_tag",
    "_unpack",
    "apply_ucx_env_defaults",
    "ucx_available",
]
