"""vLLM engines take calls only with the serving key (issue #46, item 1): `kvpool up` starts each engine
with the key as vLLM's API key (`VLLM_API_KEY`, which vLLM reads as `--api-key`; an environment keeps
it out of the command line others may read), and the router over vLLM engines sends it.

Real processes where it matters: a real master on 127.0.0.1:0; the engines are small HTTP servers that
check `Authorization: Bearer` as vLLM's `--api-key` does (a real vLLM engine is too heavy here; the
launch plan's environment is checked below)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from kvpool.client import EngineNamespace, MasterClient, NodeInfo
from kvpool.master.server import serve
from kvpool.master.settings import MasterSettings
from kvpool.router.settings import RouterSettings
from kvpool.router.tenants import Tenants
from kvpool.router.vllm_http import build_vllm_app
from kvpool.router.vllm_pd import VllmEngines
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.rpc.serving_key import KEY_FILE_ENV
from kvpool.types import DEFAULT_LAYOUT
from tests.asgi_server import AsgiServer

KEY = "k" * 43


class KeyedEngine:
    """An OpenAI server on 127.0.0.1:0 that answers 401 without `Authorization: Bearer KEY` (as vLLM with
    `--api-key KEY`), and records what it served."""

    def __init__(self) -> None:
        self.served: list[str] = []
        self.refused = 0
        app = Starlette(
            routes=[
                Route("/tokenize", self._answer, methods=["POST"]),
                Route("/v1/completions", self._answer, methods=["POST"]),
                Route("/v1/models", self._answer),
            ]
        )
        self._server = AsgiServer(app)
        self.url = self._server.url

    def stop(self) -> None:
        self._server.stop()

    async def _answer(self, request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {KEY}":
            self.refused += 1
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        self.served.append(request.url.path)
        if request.url.path == "/tokenize":
            return JSONResponse({"tokens": list(range(40)), "count": 40})
        if request.url.path == "/v1/models":
            return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})
        body = await request.json()
        if body.get("max_tokens") == 1:
            return JSONResponse({"choices": [{"text": "p"}], "kv_transfer_params": {"kvpool": {}}})
        return JSONResponse({"choices": [{"text": "decoded"}], "usage": {"prompt_tokens": 40}})


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    key_file = tmp_path / "serving_key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    monkeypatch.setenv(KEY_FILE_ENV, str(key_file))
    master = serve(MasterSettings(port=0, bind_host="127.0.0.1", metrics=False))
    engines = {"p0": KeyedEngine(), "d0": KeyedEngine()}
    mc = MasterClient(master.address)
    ns = EngineNamespace("m", "w1", DEFAULT_LAYOUT, "vllm-test")
    for node_id, role in (("p0", "vllm-prefill"), ("d0", "vllm-decode")):
        mc.register_node(
            NodeInfo(node_id, role, "", "", 1, engines[node_id].url, ns),
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=DEFAULT_LAYOUT,
        )
    try:
        yield {"master": master, "engines": engines, "client": mc}
    finally:
        mc.close()
        for e in engines.values():
            e.stop()
        master.stop()


def test_the_vllm_router_sends_the_serving_key_to_engines(setup: dict[str, Any]) -> None:
    import httpx

    settings = RouterSettings(master=setup["master"].address, engines="vllm", node_backoff_s=30.0)
    engines = VllmEngines(settings, setup["client"]).start()
    with TestClient(build_vllm_app(engines, Tenants.open())) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hello " * 40, "max_tokens": 5})
        assert r.status_code == 200, r.text
    p0, d0 = setup["engines"]["p0"], setup["engines"]["d0"]
    assert "/v1/completions" in p0.served and "/v1/completions" in d0.served
    assert p0.refused == d0.refused == 0
    # the engine itself refuses a caller without the key (what the router's key is for)
    assert httpx.post(p0.url + "/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 401


def test_up_starts_vllm_engines_with_the_serving_key_as_their_api_key(tmp_path: Path) -> None:
    from kvpool.cluster.credentials import UpCredentials
    from kvpool.cluster.launch import plan
    from kvpool.cluster.spec import ClusterSpec

    spec = ClusterSpec.model_validate(
        {"prefill": {"engine": "vllm", "python": "python"}, "decode": {"engine": "vllm", "python": "python"}}
    )
    launches = plan(spec, DEFAULT_LAYOUT)
    creds = UpCredentials.make(tmp_path, {}, launches)
    key = Path(creds.caller_env[KEY_FILE_ENV]).read_text().strip()
    engines = [x for x in launches if x.argv]
    assert {x.role for x in engines} == {"vllm-prefill", "vllm-decode"}
    for launch in engines:
        assert creds.env_for(launch)["VLLM_API_KEY"] == key
        assert key not in " ".join(launch.argv)  # never on the command line (/proc/PID/cmdline is public)
        host = launch.argv[launch.argv.index("--host") + 1]
        assert host == "127.0.0.1"  # the configured host, not every interface
    router = next(x for x in launches if x.role == "router")
    assert creds.env_for(router)[KEY_FILE_ENV] == creds.caller_env[KEY_FILE_ENV]
