"""Run a test case with an in-process UCX server in a new interpreter.

Client and server then share one UCX worker, and a process whose earlier tests aborted connections (or,
in a full run, that hosted other modules' UCX work) has active-message receives orphaned on recycled
endpoint handles (transfer/ucx_runtime.py), which can swallow a reply to a new in-process server: a
handshake or request that never completes. A fresh interpreter has none.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.capabilities import skip_unless

_CASE = """
from {module} import {name} as case
from transfer import UcxTransport
t = UcxTransport({transport_kwargs})
try:
    case(t, *{args!r})
finally:
    t.close()
print("CASE OK")
"""


def in_fresh_process(module: str, name: str, *args: object, transport_kwargs: str = "") -> None:
    """`module.name(transport, *args)` in a new interpreter (`args`: literals); fails with its stderr."""
    from transfer import ucx_available

    skip_unless("ucx", ucx_available())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _CASE.format(module=module, name=name, args=tuple(args), transport_kwargs=transport_kwargs)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0 and "CASE OK" in out.stdout, out.stderr[-4000:]
