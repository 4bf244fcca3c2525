"""`kvpool decode`: run a decode node."""

from __future__ import annotations

from typing import Any

from kvpool.serving.common import ServingSettings
from kvpool.serving.metrics import LatencyMetric
from kvpool.serving.runtime import NodeRuntime
from kvpool.serving.serve import serve_node

TPOT = LatencyMetric("tpot_seconds", "Mean time per output token after the first, per request.")
"""The decode node's latency: `kvpool_decode_tpot_seconds`."""


def main(settings: ServingSettings) -> None:
    def build(rt: NodeRuntime) -> tuple[list[tuple[Any, Any, str]], Any, Any]:
        from decode_node.scheduler import DecodeScheduler
        from decode_node.service import DecodeService
        from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

        scheduler = DecodeScheduler(rt, max_batch_size=rt.settings.max_batch_size)
        scheduler.start()
        service = DecodeService(rt, scheduler)
        return (
            [(pb_grpc.add_DecodeServicer_to_server, service, "kvpool.v1.Decode")],
            lambda: scheduler.queue_len,
            scheduler.stop,
        )

    serve_node(settings, role="decode", latency=TPOT, build=build)
