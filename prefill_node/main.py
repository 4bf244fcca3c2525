"""`kvpool prefill`: run a prefill node."""

from __future__ import annotations

from typing import Any

from kvpool.serving.common import ServingSettings
from kvpool.serving.metrics import LatencyMetric
from kvpool.serving.runtime import NodeRuntime
from kvpool.serving.serve import serve_node

TTFT = LatencyMetric("ttft_seconds", "Time to first token on the node (load + compute).")
"""The prefill node's latency: `kvpool_prefill_ttft_seconds`."""


def main(settings: ServingSettings) -> None:
    def build(rt: NodeRuntime) -> tuple[list[tuple[Any, Any, str]], Any, Any]:
        from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
        from prefill_node.service import PrefillService

        service = PrefillService(rt)
        return (
            [(pb_grpc.add_PrefillServicer_to_server, service, "kvpool.v1.Prefill")],
            lambda: service.queue_len,
            lambda: None,
        )

    serve_node(settings, role="prefill", latency=TTFT, build=build)
