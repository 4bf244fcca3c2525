"""The election's etcd client: `aetcd.Client` with etcd's own auth (user and password: `Authenticate`, then
its token on every call) and, where `EtcdAuth.tls`, a TLS channel (grpc's own credentials: the CA, and a
client certificate when given). `aetcd` itself only opens plain channels; this opens the TLS one and keeps
the rest of its `connect` (stubs, auth token, watcher)."""

from __future__ import annotations

from pathlib import Path

import aetcd
import grpc
from aetcd import rpc, watcher

from kvpool.master.ha.endpoints import EtcdAuth


class EtcdClient(aetcd.Client):
    """An `aetcd.Client` to `host:port` as `auth` says (`timeout_s` bounds each call, connecting too)."""

    def __init__(self, host: str, port: int, auth: EtcdAuth, timeout_s: float) -> None:
        super().__init__(
            host=host,
            port=port,
            username=auth.user or None,
            password=auth.password or None,
            timeout=timeout_s,  # type: ignore[arg-type]  # aetcd passes it to grpc, which takes a float
        )
        self._credentials: grpc.ChannelCredentials | None = None
        if auth.tls:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=Path(auth.ca_file).read_bytes(),
                private_key=Path(auth.key_file).read_bytes() if auth.key_file else None,
                certificate_chain=Path(auth.cert_file).read_bytes() if auth.cert_file else None,
            )

    async def connect(self) -> None:
        if self._credentials is None or self._connected.is_set():
            await super().connect()
            return
        try:
            self.channel = grpc.aio.secure_channel(
                f"{self._host}:{self._port}", self._credentials, options=list(self._options.items())
            )
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                self.metadata = (("token", reply.token),)
        except rpc.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(
            rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
        )
        self._connected.set()
