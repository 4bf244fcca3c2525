"""The event loop of gRPC servers and the lean load generator: uvloop (a dependency) when importable."""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import pytest
import uvloop

from kvpool.rpc import loop as rpc_loop
from kvpool.rpc.aio_server import AioGrpcServer


def test_servers_run_on_uvloop() -> None:
    server = AioGrpcServer()
    try:
        assert isinstance(server.loop, uvloop.Loop)
    finally:
        server.loop.close()


def test_run_uses_the_loop_factory() -> None:
    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert rpc_loop.run(which()).startswith("uvloop")


def test_falls_back_to_the_stdlib_loop_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    loop = rpc_loop.new_event_loop()
    try:
        assert not isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
    finally:
        loop.close()
