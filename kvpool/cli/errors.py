"""One clear line instead of a traceback when a long-running role fails to start or stops on an error."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

import typer

log = logging.getLogger("kvpool.cli")


def run_or_exit(role: str, fn: Callable[[], None]) -> None:
    """Run `fn` (a role's serve loop). An exception becomes `kvpool ROLE: Type: message` on stderr and exit
    status 1, or 2 when a retry cannot help: the listening address cannot be bound (in use, not this host's,
    not permitted) or the master refused this process as a member (no or a revoked join token); `kvpool up`
    does not restart a role that exits 2. The traceback is logged at debug level (`kvpool -v ...`). Ctrl-C
    and exits pass through."""
    from kvpool.errors import PermissionDenied, Unauthenticated

    try:
        fn()
    except (KeyboardInterrupt, SystemExit, typer.Exit):
        raise
    except Exception as exc:  # noqa: BLE001 - one clear line, no traceback
        log.debug("%s failed", role, exc_info=True)
        typer.echo(f"kvpool {role}: {type(exc).__name__}: {exc}", err=True)
        refused = isinstance(exc, (Unauthenticated, PermissionDenied))
        unbindable = isinstance(exc, OSError) and exc.errno in _UNBINDABLE
        raise typer.Exit(2 if refused or unbindable else 1) from None


_UNBINDABLE = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)
"""A listening address that will not work on a retry: in use, not an address of this host, not permitted."""
