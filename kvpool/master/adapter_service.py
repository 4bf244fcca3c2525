"""The adapter RPCs of the `kvpool.v1.Master` servicer (`RegisterAdapter`, `ReloadAdapter`, `UnloadAdapter`,
`ListAdapters`): proto in, `kvpool.master.adapters` call, proto out. Mixed into `MasterServicer`."""

from __future__ import annotations

import grpc

from kvpool.master import adapters
from kvpool.master.adapters import AdapterChange
from kvpool.master.core import Master
from kvpool.master.wire import short
from kvpool.rpc.status import rpc_errors
from kvpool.v1 import kvpool_pb2 as pb


def _change(c: AdapterChange) -> pb.AdapterChangeResponse:
    return pb.AdapterChangeResponse(
        previous_digest=c.previous_digest,
        num_namespaces_invalidated=c.num_namespaces_invalidated,
        num_blocks_invalidated=c.num_blocks_invalidated,
    )


class AdapterRpcs:
    m: Master

    @rpc_errors
    def RegisterAdapter(
        self, request: pb.RegisterAdapterRequest, context: grpc.ServicerContext
    ) -> pb.RegisterAdapterResponse:
        created = adapters.register_adapter(
            self.m, short(request.model_id, "model_id"), short(request.name, "name"), request.digest
        )
        return pb.RegisterAdapterResponse(created=created)

    @rpc_errors
    def ReloadAdapter(
        self, request: pb.ReloadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.AdapterChangeResponse:
        return _change(
            adapters.reload_adapter(
                self.m, short(request.model_id, "model_id"), short(request.name, "name"), request.digest
            )
        )

    @rpc_errors
    def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.AdapterChangeResponse:
        return _change(
            adapters.unload_adapter(self.m, short(request.model_id, "model_id"), short(request.name, "name"))
        )

    @rpc_errors
    def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext
    ) -> pb.ListAdaptersResponse:
        found = adapters.list_adapters(self.m, short(request.model_id, "model_id"))
        return pb.ListAdaptersResponse(
            adapters=[
                pb.AdapterInfo(
                    model_id=a.model_id,
                    name=a.name,
                    digest=a.digest,
                    num_namespaces=a.num_namespaces,
                    num_blocks=a.num_blocks,
                )
                for a in found
            ]
        )
