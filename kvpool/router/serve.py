"""Run the router until SIGTERM/SIGINT: uvicorn on a socket bound first, so port 0 works and the READY
line names the real address (`KVPOOL_READY {"http_address": "host:port", ...}`)."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from typing import Any

from kvpool.router.settings import RouterSettings

log = logging.getLogger(__name__)


def build(settings: RouterSettings) -> tuple[object, object]:
    """(Starlette app, RouterService) for `settings`: connects to the master and reads the model."""
    from kvpool.client import MasterClient
    from kvpool.router.http import build_app
    from kvpool.router.model_info import ModelInfo
    from kvpool.router.service import RouterService
    from kvpool.router.tenants import Tenants

    tenants = Tenants.from_settings(settings.tenants, settings.tenant_salt_key_file)
    master = MasterClient(settings.master)
    if settings.engines == "vllm":
        from kvpool.router.vllm_http import build_vllm_app
        from kvpool.router.vllm_pd import VllmEngines

        engines = VllmEngines(settings, master).start()
        return build_vllm_app(engines, tenants), engines
    block_size = settings.block_size or _pool_block_size(master, settings.master_wait_s)
    model = ModelInfo.load(settings.model, block_size=block_size)
    _check_layout(master, model)
    service = RouterService(settings, master, model).start()
    app = build_app(service, tenants, model_name=settings.served_model_name)
    return app, service


def _pool_block_size(master: Any, wait_s: float) -> int:
    """The pool's block size, asked of the master, waited for up to `wait_s` while it is unreachable (the
    serving nodes' `wait_for_master`); then `Unavailable` saying what to do (a router given `--block-size`
    starts without it and answers 503 until it is back)."""
    from kvpool.client.master_wait import wait_for_master
    from kvpool.errors import Unavailable

    try:
        return int(wait_for_master(master, wait_s).block_size)
    except Unavailable as exc:
        raise Unavailable(
            f"{exc}; the router takes the pool's block size from it: start the master first, or give "
            "--block-size to start without it"
        ) from None


def _check_layout(master: Any, model: Any) -> None:
    """Refuse to start when the master refuses this router's KV layout (a `--block-size` or model other
    than the pool's): every peek would miss; and when the master refuses it as a member (no or a revoked
    join token). A master that is down is no refusal (503 until it is back)."""
    from kvpool.errors import InvalidArgument, KVPoolError, PermissionDenied, Unauthenticated

    info = model.namespace("")
    try:
        master.register_namespace(info.model_id, info.weights_version, info.layout.fingerprint())
    except InvalidArgument as exc:
        raise InvalidArgument(
            f"the master refuses this router's KV layout: {exc} (give the pool's --block-size and --model, "
            "or no --block-size to take the pool's)"
        ) from None
    except (Unauthenticated, PermissionDenied):
        raise
    except KVPoolError as exc:
        log.warning("could not check the KV layout with the master (%s): checked on first use", exc)


def serve(settings: RouterSettings) -> None:
    import uvicorn

    from kvpool.rpc.process import print_ready

    app, service = build(settings)
    sock = socket.socket(socket.AF_INET6 if ":" in settings.bind_host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.bind_host, settings.port))
    except OSError as exc:  # the CLI prints it as one line: say which address
        sock.close()
        raise OSError(
            exc.errno, f"cannot bind the router to {settings.bind_host}:{settings.port}: {exc.strerror}"
        ) from None
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        log_level="warning",
        timeout_graceful_shutdown=5,
        access_log=False,
        # uvicorn counts the connection a request came on: max_connections served, a request on one more 503
        limit_concurrency=settings.max_connections + 1,
    )
    server = uvicorn.Server(config)

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            model = getattr(service, "model", None)
            print_ready(
                {
                    "http_address": f"{host}:{port}",
                    "role": "router",
                    "policy": settings.policy,
                    "engines": settings.engines,
                    "model_id": model.model_id if model else "",
                }
            )

    threading.Thread(target=announce, name="router-ready", daemon=True).start()
    log.info("router (%s) for master %s on http://%s:%d", settings.policy, settings.master, host, port)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the handler it found:
    # this one makes that a clean exit (0), as the other roles' (the default handler's death said 143)
    signal.signal(signal.SIGTERM, _exit_cleanly)
    server.run(sockets=[sock])


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)
