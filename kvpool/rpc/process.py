"""What a role process and its launcher agree on: the ready line and dying with the parent.

Every role command prints exactly one `KVPOOL_READY <json>` line on stdout when it serves (its bound
addresses in the JSON), so a parent never guesses ports (`kvpool.cluster.process` reads it). Children die
with their parent on Linux (`PR_SET_PDEATHSIG`), so a killed launcher leaves no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import sys
from typing import Any

READY_PREFIX = "KVPOOL_READY "
_PR_SET_PDEATHSIG = 1


def print_ready(info: dict[str, Any]) -> None:
    """Announce that this process serves: one machine-readable line on stdout, flushed."""
    sys.stdout.write(READY_PREFIX + json.dumps(info, sort_keys=True) + "\n")
    sys.stdout.flush()


def _resolve_prctl() -> Any:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform.startswith("linux") else None
    except OSError:
        return None


_PRCTL = _resolve_prctl()
"""libc's prctl, resolved here in the parent: a dlopen in the child of a threaded parent can deadlock on the
loader's lock held by another thread at fork time (seen as a role that never started under `kvpool up`)."""


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """In a child before exec: receive SIGTERM when the parent dies (Linux `PR_SET_PDEATHSIG`)."""
    if _PRCTL is not None:
        with contextlib.suppress(Exception):
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
