"""`kvpool prefill`: run a prefill node."""

from __future__ import annotations

from kvpool.serving.common import ServingSettings
from kvpool.serving.metrics import LatencyMetric
from kvpool.serving.serve import serve_node, start_node

TTFT = LatencyMetric("ttft_seconds", "Time to first token on the node (load + compute).")
"""The prefill node's latency: `kvpool_prefill_ttft_seconds`."""


def main(settings: ServingSettings) -> None:
    from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
    from prefill_node.service import PrefillService

    rt = start_node(settings, role="prefill", latency=TTFT)
    service = PrefillService(rt)
    serve_node(
        rt,
        [(pb_grpc.add_PrefillServicer_to_server, service, "kvpool.v1.Prefill")],
        queue_len=lambda: service.queue_len,
    )
