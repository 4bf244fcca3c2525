"""What a role process and its launcher agree on: the ready line and dying with the parent.

Every role command prints exactly one `KVPOOL_READY <json>` line on stdout when it serves (its bound
addresses in the JSON), so a parent never guesses ports (`kvpool.cluster.process` reads it). Children die
with their parent on Linux (`PR_SET_PDEATHSIG`), so a killed launcher leaves no orphans.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

READY_PREFIX = "KVPOOL_READY "


def print_ready(info: dict[str, Any]) -> None:
    """Announce that this process serves: one machine-readable line on stdout, flushed."""
    sys.stdout.write(READY_PREFIX + json.dumps(info, sort_keys=True) + "\n")
    sys.stdout.flush()


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """`argv` wrapped so that the child it starts receives SIGTERM when this process dies (Linux
    `PR_SET_PDEATHSIG`, armed by `kvpool.rpc.deathsig` before it execs `argv`); `argv` unchanged elsewhere.
    Start it without a `preexec_fn` (see `kvpool.rpc.deathsig`)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-m", "kvpool.rpc.deathsig", str(os.getpid()), "--", *argv]
