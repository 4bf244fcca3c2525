"""The UCX loop thread runs at its process's priority: at nice 19 a node's transfers and a store's serving
got ~1.5 % of a core next to any CPU-bound process, and a loaded host took seconds to open a connection
(docs/transport.md, "Idle nodes sleep")."""

from __future__ import annotations

import os
import threading

from tests.test_store_node import require_ucx
from transfer import UcxTransport


def test_the_ucx_loop_thread_runs_at_the_process_priority() -> None:
    require_ucx()
    t = UcxTransport()
    try:
        loops = [th for th in threading.enumerate() if th.name == "kvpool-ucx"]
        assert len(loops) == 1 and loops[0].native_id is not None
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert os.getpriority(os.PRIO_PROCESS, loops[0].native_id) == own
    finally:
        t.close()
