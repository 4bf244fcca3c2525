"""The connector between a node's model cache and the pool: load a prompt's cached prefix (node-local
tier first, then a pull from the pool when the cost model says so) and publish new full blocks.

Shared by the prefill and decode nodes.
"""

from kvpool.connector.local_tier import LocalTier

__all__ = ["LocalTier"]
