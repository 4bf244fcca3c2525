"""Before a serving node loads its model: wait for the master, and find out what it would refuse.

Loading a model takes seconds (minutes for a large one), and the master checks a node only when it
registers, after that. `check_master` runs first (`kvpool.serving.serve.start_node`):

1. it waits for the master with back-off while it is unreachable, at most `master_wait_s` (one log line
   per attempt, `kvpool.client.master_wait`), then raises `Unavailable` (one line);
2. it asks the master's `Stats` with this node's join token: a token the master refuses raises its
   `Unauthenticated`;
3. it compares what it can locally: the pool's block size (`Stats.block_size`) and the pool's layout
   fingerprint (the `GetInfo` of a live registered member, which the master admitted with that layout)
   against the layout the node will have (`kvpool.model.runner.model_layout`, from the model directory
   without its weights), and whether a live member answers under this node's id (`AlreadyExists`, the
   master's own duplicate probe). A mismatch raises `FailedPrecondition` naming both layouts.

The master has no dry-run registration: the protocol version is checked at registration only, and the
layout only when a live member can be asked (a master with no live member: the block size only).
"""

from __future__ import annotations

import logging

from kvpool.client import MasterClient
from kvpool.client.master_wait import wait_for_master
from kvpool.client.store_client import node_identity
from kvpool.client.types import PoolStats
from kvpool.errors import AlreadyExists, FailedPrecondition
from kvpool.types import KVLayout

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 2.0
"""How long a live member's `GetInfo` may take."""


def check_refusals(stats: PoolStats, layout: KVLayout, node_id: str) -> None:
    """Raise what the master would answer this node's registration, as far as `stats` and the live
    members tell: `FailedPrecondition` (layout) or `AlreadyExists` (node id); see the module docstring."""
    if stats.block_size and stats.block_size != layout.block_size:
        raise FailedPrecondition(
            f"the master refuses this node: its pool's block size is {stats.block_size} tokens, this "
            f"node's is {layout.block_size} (layout {layout.fingerprint()!r}); start it with "
            f"--block-size {stats.block_size}, or the master with this node's layout (`kvpool layout`)"
        )
    pool_layout = ""
    for node in stats.nodes:
        if not node.alive:
            continue
        same_id = node.node.node_id == node_id
        if not same_id and pool_layout:
            continue
        info = node_identity(node.node.grpc_address, node.node.role, timeout_s=_PROBE_TIMEOUT_S)
        if info is None:
            continue
        if same_id and info.node_id == node_id:
            raise AlreadyExists(
                f"the master refuses this node: node id {node_id!r} is held by a live {node.node.role} at "
                f"{node.node.grpc_address}: give every node its own --node-id"
            )
        pool_layout = pool_layout or info.layout_fingerprint
    if pool_layout and pool_layout != layout.fingerprint():
        raise FailedPrecondition(
            f"the master refuses this node: layout {layout.fingerprint()!r} does not match the pool's "
            f"{pool_layout!r} (`kvpool layout --model DIR` prints a model's layout)"
        )


def check_master(address: str, wait_s: float, layout: KVLayout, node_id: str) -> None:
    """Wait for the master at `address` (at most `wait_s` seconds) and raise what it would refuse
    (`Unavailable`, `Unauthenticated`, `FailedPrecondition`, `AlreadyExists`); see the module docstring."""
    with MasterClient(address, timeout_s=2.0) as master:
        stats = wait_for_master(master, wait_s)
    check_refusals(stats, layout, node_id)
