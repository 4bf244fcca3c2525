"""`kvpool decode`: run a decode node."""

from __future__ import annotations

from typing import Any

from kvpool.serving.common import ServingSettings
from kvpool.serving.runtime import NodeRuntime
from kvpool.serving.serve import serve_node


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

    serve_node(settings, role="decode", build=build)
