"""Prometheus `/metrics` for the gRPC roles (master, store, prefill, decode): one HTTP server per role
instance, prometheus-client's own (`start_http_server`), over that instance's own `CollectorRegistry`, so
tests can run several roles in one process. The router serves `/metrics` on its API port instead.

Every role's settings carry `metrics` (on/off) and `metrics_port` (0 = ephemeral) on the role's
`bind_host`; the role announces the bound address as `metrics_address` in its `KVPOOL_READY` line.
Metric names are `kvpool_<role>_…` with units in the name (`_bytes`, `_seconds`, `_tokens`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram buckets (seconds) for transfers, TTFT and TPOT."""


class MetricsServer:
    """A running `/metrics` endpoint; `address` is "host:port" (the bound port). The caller owns it and
    calls `stop()` (idempotent)."""

    def __init__(self, server: Any, thread: threading.Thread, host: str) -> None:
        self._server = server
        self._thread = thread
        self.port: int = int(server.server_port)
        self.address = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2.0)
        self._server = None


def start_metrics_server(
    registry: CollectorRegistry, *, host: str, port: int, advertise_host: str = ""
) -> MetricsServer:
    """Serve `registry` on `http://host:port/metrics` (port 0 = ephemeral) from a daemon thread.

    `advertise_host` (default `host`) is the host put in `MetricsServer.address`. Raises `OSError` when
    the port cannot be bound.
    """
    server, thread = start_http_server(port, addr=host, registry=registry)
    metrics = MetricsServer(server, thread, advertise_host or host)
    log.info("metrics on %s", metrics.url)
    return metrics


def maybe_start(
    registry: CollectorRegistry, *, enabled: bool, host: str, port: int, advertise_host: str = ""
) -> MetricsServer | None:
    """`start_metrics_server` when `enabled`, else None (the role then announces `metrics_address: ""`)."""
    if not enabled:
        return None
    return start_metrics_server(registry, host=host, port=port, advertise_host=advertise_host)


def address_of(server: MetricsServer | None) -> str:
    """The `metrics_address` a role announces ("" when metrics are off)."""
    return server.address if server is not None else ""
