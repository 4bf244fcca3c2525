"""An ASGI app served by uvicorn on an ephemeral 127.0.0.1 port in a thread: the tests' fake engines."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class AsgiServer:
    """Serve `app` now on 127.0.0.1:0 (`url` is `http://127.0.0.1:PORT`); `stop()` ends it."""

    def __init__(self, app: Any) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)
