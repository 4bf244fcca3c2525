"""The master servicer for the `grpc.aio` server: matches run on the event loop (no thread hand-off per
call or stream message); every other method stays sync and runs on the server's thread pool (they may
wait on store calls). Validation and status mapping are the sync servicer's (`MasterServicer._match`)."""

from __future__ import annotations

from typing import Any

import grpc

from kvpool.errors import InvalidArgument
from kvpool.master.service import MasterServicer
from kvpool.rpc.aio_server import abort_async
from kvpool.v1 import kvpool_pb2 as pb


class AioMasterServicer(MasterServicer):
    async def MatchPrefix(  # type: ignore[override]
        self, request: pb.MatchPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.MatchPrefixResponse:
        try:
            return self._match(request, self._owner(context))
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            await abort_async(context, "MatchPrefix", exc)
            raise AssertionError("unreachable") from exc  # abort raises

    async def MatchPrefixStream(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> None:
        """Reads and writes on the context (no async-generator layers per message); parses itself."""
        try:
            owner = self._owner(context)
            while True:
                raw = await context.read()
                if raw is grpc.aio.EOF:
                    return
                try:
                    request = pb.MatchPrefixRequest.FromString(raw)
                except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad input
                    raise InvalidArgument(f"malformed request for MatchPrefixStream: {exc}") from None
                await context.write(self._match(request, owner))
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            await abort_async(context, "MatchPrefixStream", exc)

    MatchPrefixStream.raw_requests = True  # type: ignore[attr-defined]
