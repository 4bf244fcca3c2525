"""`python -m kvpool.rpc.deathsig PARENT_PID -- ARGV...`: run ARGV so that it dies with process PARENT_PID.

Sets `PR_SET_PDEATHSIG` (SIGTERM), which survives the `exec` of ARGV, then execs it; exits 1 at once when
PARENT_PID is no longer this process's parent (it died before the signal was armed). The launchers
(`kvpool.cluster.process`, `kvpool.master.procs`) start every child through it instead of a `preexec_fn`:
a Python callback between fork and exec forces a full `fork()` of a threaded launcher, which runs every
`pthread_atfork` handler (gRPC's among them) and can deadlock; without one, `subprocess` uses `vfork`.
Linux only; imports nothing heavy (it runs before every role starts).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        sys.stderr.write("usage: python -m kvpool.rpc.deathsig PARENT_PID -- ARGV...\n")
        return 2
    parent_pid, cmd = int(argv[0]), argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        sys.stderr.write(f"kvpool: prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}\n")
    if os.getppid() != parent_pid:  # the launcher died before the signal was armed: do not start
        return 1
    os.execvp(cmd[0], cmd)  # noqa: S606 - the launcher's own command line; raises OSError if it cannot


if __name__ == "__main__":  # pragma: no cover - exercised through subprocesses
    sys.exit(main(sys.argv[1:]))
