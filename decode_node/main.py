"""`kvpool decode`: run a decode node."""

from __future__ import annotations

from kvpool.serving.common import ServingSettings
from kvpool.serving.metrics import LatencyMetric
from kvpool.serving.serve import serve_node, start_node

TPOT = LatencyMetric("tpot_seconds", "Mean time per output token after the first, per request.")
"""The decode node's latency: `kvpool_decode_tpot_seconds`."""


def main(settings: ServingSettings) -> None:
    from decode_node.scheduler import DecodeScheduler
    from decode_node.service import DecodeService
    from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

    rt = start_node(settings, role="decode", latency=TPOT)
    scheduler = DecodeScheduler(rt, max_batch_size=rt.settings.max_batch_size)
    scheduler.start()
    service = DecodeService(rt, scheduler)
    serve_node(
        rt,
        [(pb_grpc.add_DecodeServicer_to_server, service, "kvpool.v1.Decode")],
        queue_len=lambda: scheduler.queue_len,
        on_stop=scheduler.stop,
    )
