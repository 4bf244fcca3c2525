"""The master: the gRPC service over the global radix index (placement, leases, node registry, versions).

`serve(settings)` starts one; `Master` is the service's state and logic (proto-free, thread-safe).
"""

from kvpool.master.core import Master
from kvpool.master.server import MasterServer, serve
from kvpool.master.settings import MasterSettings

__all__ = ["Master", "MasterServer", "MasterSettings", "serve"]
