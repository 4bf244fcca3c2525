"""Optional bearer-token authentication and TLS for every gRPC server and channel of the cluster.

Configured once per process from `KVPOOL_AUTH_TOKEN`, `KVPOOL_TLS_CERT_FILE`, `KVPOOL_TLS_KEY_FILE` and
`KVPOOL_TLS_CA_FILE` (or a TOML file; see `RpcSecurity`). With a token, every server refuses calls that do
not carry `authorization: Bearer <token>` with UNAUTHENTICATED (the health check stays open for probes),
and every channel made by `kvpool.rpc.server.channel` sends it. With a certificate and key, servers
listen with TLS; with a CA file, channels verify the server against it (and present the certificate and
key as their client certificate when both are set). `KVPOOL_TLS_CLIENT_AUTH=true` makes servers refuse a
connection without a client certificate signed by the CA (mutual TLS; `kvpool up` turns it on). Tokens
are compared in constant time (`hmac.compare_digest`). Every server and channel of the cluster gets its
credentials here (`server_credentials`, `channel_credentials`).

Separately, a node or client of a secured cluster presents its **join token** (`KVPOOL_JOIN_TOKEN`, or
the file named by `KVPOOL_JOIN_TOKEN_FILE`; `kvpool.membership`) in the `kvpool-join-token` metadata of
every call; the master refuses calls without an active one. And the router (and the admin) present the
**serving key** (`kvpool.rpc.serving_key`) on their `Prefill`/`Decode` calls, which a serving node with
the key's digest requires.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from pydantic import Field

from kvpool.config import KVPoolSettings, load_config
from kvpool.membership import JOIN_TOKEN_METADATA
from kvpool.rpc.serving_key import call_metadata, server_gate, serving_key

_OPEN_METHODS = ("/grpc.health.v1.Health/",)


class RpcSecurity(KVPoolSettings):
    """Transport security of the cluster's gRPC (env `KVPOOL_AUTH_TOKEN`, `KVPOOL_TLS_*_FILE`)."""

    auth_token: str = Field(default="", description="shared bearer token; empty = no authentication")
    tls_cert_file: str = Field(default="", description="server certificate (PEM); empty = no TLS")
    tls_key_file: str = Field(default="", description="server private key (PEM)")
    tls_ca_file: str = Field(
        default="", description="CA bundle clients verify servers against (and servers verify clients, PEM)"
    )
    tls_client_auth: bool = Field(
        default=False, description="servers require a client certificate signed by tls_ca_file (mutual TLS)"
    )
    tls_server_name: str = Field(
        default="", description="name the servers' certificate is checked for; '' = the address's host"
    )
    join_token: str = Field(default="", description="join token presented to a secured master")
    join_token_file: str = Field(default="", description="file holding the join token (first line)")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file or self.tls_ca_file)


@functools.lru_cache(maxsize=1)
def security() -> RpcSecurity:
    """This process's settings, read once (tests call `security.cache_clear()` after changing env)."""
    return load_config(RpcSecurity)


def join_token() -> str:
    """This process's join token: `join_token`, else the first line of `join_token_file`; "" when none.
    Read afresh at each call (a `LocalCluster` sets `KVPOOL_JOIN_TOKEN_FILE` while it runs). Raises
    `InvalidArgument` naming the file when it cannot be read or is empty."""
    sec = load_config(RpcSecurity)
    if sec.join_token:
        return sec.join_token
    if sec.join_token_file:
        try:
            return Path(sec.join_token_file).read_text().strip().splitlines()[0].strip()
        except (OSError, IndexError, UnicodeDecodeError) as exc:
            from kvpool.errors import InvalidArgument

            why = "it is empty" if isinstance(exc, IndexError) else exc
            raise InvalidArgument(
                f"cannot read the join token file {sec.join_token_file} (KVPOOL_JOIN_TOKEN_FILE): {why}"
            ) from None
    return ""


class _AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        from kvpool.rpc.guards import deny_handlers

        self._expected = f"Bearer {token}".encode()
        self._deny = deny_handlers("missing or invalid bearer token")

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        method = handler_call_details.method or ""
        if method.startswith(_OPEN_METHODS):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(got, self._expected):
                    return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._deny[(handler.request_streaming, handler.response_streaming)]


def server_interceptors(sec: RpcSecurity) -> list[grpc.ServerInterceptor]:
    """The bearer-token check (with `auth_token`), then the serving-key gate (with
    `KVPOOL_SERVING_KEY_SHA256`; it guards `Prefill`/`Decode` calls only)."""
    return ([_AuthInterceptor(sec.auth_token)] if sec.auth_token else []) + server_gate()


def _read(path: str, setting: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        from kvpool.errors import InvalidArgument

        raise InvalidArgument(
            f"cannot read {setting} {path} (KVPOOL_{setting.upper()}): {exc.strerror}"
        ) from None


def server_credentials(sec: RpcSecurity) -> grpc.ServerCredentials | None:
    """TLS credentials for a server (None without `tls_cert_file`): the certificate and key, and with
    `tls_client_auth` the CA that client certificates must chain to. `InvalidArgument` naming the setting
    when a file cannot be read or `tls_client_auth` has no CA."""
    if not sec.tls_cert_file:
        return None
    pair = [(_read(sec.tls_key_file, "tls_key_file"), _read(sec.tls_cert_file, "tls_cert_file"))]
    if not sec.tls_client_auth:
        return grpc.ssl_server_credentials(pair)
    if not sec.tls_ca_file:
        from kvpool.errors import InvalidArgument

        raise InvalidArgument(
            "KVPOOL_TLS_CLIENT_AUTH needs KVPOOL_TLS_CA_FILE (the CA client certificates chain to)"
        )
    ca = _read(sec.tls_ca_file, "tls_ca_file")
    return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=True)


def channel_credentials(sec: RpcSecurity) -> grpc.ChannelCredentials:
    """TLS credentials for a channel (callers use them when `tls_ca_file` is set; without it, plaintext):
    the CA to verify servers against, and this process's certificate and key as its client certificate
    when both are set. `InvalidArgument` naming the setting when a file cannot be read."""
    ca = _read(sec.tls_ca_file, "tls_ca_file")
    if sec.tls_cert_file and sec.tls_key_file:
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=_read(sec.tls_key_file, "tls_key_file"),
            certificate_chain=_read(sec.tls_cert_file, "tls_cert_file"),
        )
    return grpc.ssl_channel_credentials(root_certificates=ca)


def channel_options(options: list[tuple[str, Any]], sec: RpcSecurity) -> list[tuple[str, Any]]:
    """`options` plus the TLS name override (`tls_server_name`) when one is set."""
    if sec.tls_ca_file and sec.tls_server_name:
        return [*options, ("grpc.ssl_target_name_override", sec.tls_server_name)]
    return options


def bind(server: grpc.Server, address: str, sec: RpcSecurity) -> int:
    """Add the listening port, with TLS when a certificate is configured. Returns the bound port.

    Raises `OSError` with one plain line naming the address when it cannot be listened on (in use, or a
    host this machine does not have): checked with a plain socket first, so gRPC's own C-core error log
    is not printed for the common case."""
    check_listen_address(address)
    creds = server_credentials(sec)
    try:
        if creds is not None:
            return server.add_secure_port(address, creds)
        return server.add_insecure_port(address)
    except RuntimeError as exc:  # taken between the check and gRPC's bind
        raise OSError(f"cannot listen on {address}: {exc}") from None


def check_listen_address(address: str) -> None:
    """`OSError("port P on HOST is in use ...")` when a TCP listener on `address` ("host:port", "[v6]:port")
    cannot be opened; port 0 (ephemeral) is not checked. Uses SO_REUSEADDR as gRPC does, so a port left
    in TIME_WAIT by a previous run counts as free."""
    import errno
    import socket

    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not port_text.isdigit() or int(port_text) == 0:
        return
    port = int(port_text)
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {address}: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(f"port {port} on {host} is in use (another process listens there)") from None
            raise OSError(f"cannot listen on {address}: {exc.strerror}") from None


class CallMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `metadata(method)` to every call of a channel: fixed pairs (the bearer token, the join token),
    or pairs made per call (the master's signed calls to stores)."""

    def __init__(self, metadata: Callable[[str], list[tuple[str, str]]]) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), *self._metadata(details.method)]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(details, metadata)
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base: Any, metadata: Any) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


def secure_channel(address: str, options: list[tuple[str, Any]], sec: RpcSecurity) -> grpc.Channel:
    """A channel with TLS (when a CA is configured), the bearer token and the join token (when
    configured), and the serving key on `Prefill`/`Decode` calls (when `KVPOOL_SERVING_KEY_FILE` is set)."""
    if sec.tls_ca_file:
        creds = channel_credentials(sec)
        ch = grpc.secure_channel(address, creds, options=channel_options(options, sec))
    else:
        ch = grpc.insecure_channel(address, options=options)
    metadata = [("authorization", f"Bearer {sec.auth_token}")] if sec.auth_token else []
    token = join_token()
    if token:
        metadata.append((JOIN_TOKEN_METADATA, token))
    key = serving_key()
    if key:
        per_call = call_metadata(key)
        ch = grpc.intercept_channel(ch, CallMetadata(lambda method: metadata + per_call(method)))
    elif metadata:
        ch = grpc.intercept_channel(ch, CallMetadata(lambda _method: metadata))
    return ch
