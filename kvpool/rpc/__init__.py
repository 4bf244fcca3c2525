"""gRPC plumbing shared by every role: status mapping, server start-up, client deadlines.

Proto types stop at servicers and clients: nothing outside `kvpool.rpc`, servicers and clients sees them.
"""

PROTOCOL_VERSION = 2
"""Bumped on incompatible changes of proto/kvpool/v1 semantics; checked at node registration (2: a store's
inventory streams as packed columns with a resume cursor)."""
