"""vLLM engines as cluster members (issue #25): an engine registers as `vllm`, `vllm-prefill` or
`vllm-decode` with its OpenAI URL, heartbeats its load (requests in flight, KV cache usage) and leaves on
deregistration; `kvpool admin nodes` lists it. Against a real master on 127.0.0.1:0."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from kvpool.client import MasterClient, NodeInfo, NodeLoad
from kvpool.client.master_link import HeartbeatReport, MasterLink, new_epoch
from kvpool.errors import InvalidArgument
from kvpool.master.server import MasterServer, serve
from kvpool.master.settings import MasterSettings
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.types import DEFAULT_LAYOUT


@pytest.fixture
def master() -> Iterator[MasterServer]:
    server = serve(MasterSettings(port=0, bind_host="127.0.0.1", metrics=False, heartbeat_interval_ms=100))
    try:
        yield server
    finally:
        server.stop()


def _nodes(address: str) -> dict[str, object]:
    with MasterClient(address) as mc:
        return {n.node.node_id: n for n in mc.list_nodes()}


def test_an_engine_registers_its_role_url_and_load_and_leaves(master: MasterServer) -> None:
    load = HeartbeatReport(load=NodeLoad(queue_len=3, kv_usage=0.25))
    with MasterClient(master.address) as mc:
        agents = [
            MasterLink(
                mc,
                NodeInfo(f"e-{role}", role, "", "", new_epoch(), f"http://127.0.0.1:{8100 + i}/"),
                layout_fingerprint=DEFAULT_LAYOUT,
                report=lambda: load,
            )
            for i, role in enumerate(("vllm-prefill", "vllm-decode", "vllm"))
        ]
        for a in agents:
            a.start()
        try:
            import time

            time.sleep(0.4)  # a few heartbeats
            nodes = _nodes(master.address)
            for i, role in enumerate(("vllm-prefill", "vllm-decode", "vllm")):
                n = nodes[f"e-{role}"]
                assert n.node.role == role and n.node.url == f"http://127.0.0.1:{8100 + i}"  # type: ignore[attr-defined]
                assert n.load.queue_len == 3 and math.isclose(n.load.kv_usage, 0.25)  # type: ignore[attr-defined]
                assert n.alive  # type: ignore[attr-defined]
        finally:
            for a in agents:
                a.stop()
    assert not any(n.alive for n in _nodes(master.address).values())  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("role", "url", "expected"),
    [
        ("vllm", "ftp://127.0.0.1:1", r"http\(s\)://host:port"),
        ("vllm-decode", "http://127.0.0.1:1/v1", r"http\(s\)://host:port"),
        ("prefill", "http://127.0.0.1:1", "only vLLM engines"),
        ("vllm-both", "", "role must be one of"),
    ],
)
def test_a_bad_engine_registration_is_invalid_argument(
    master: MasterServer, role: str, url: str, expected: str
) -> None:
    with MasterClient(master.address) as mc, pytest.raises(InvalidArgument, match=expected):
        mc.register_node(
            NodeInfo("e", role, "", "", 1, url),
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=DEFAULT_LAYOUT,
        )


def test_kv_usage_outside_a_fraction_is_refused(master: MasterServer) -> None:
    with MasterClient(master.address) as mc:
        mc.register_node(
            NodeInfo("e", "vllm", "", "", 1, "http://127.0.0.1:9"),
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=DEFAULT_LAYOUT,
        )
        for bad in (1.5, -0.1, float("nan")):
            with pytest.raises(InvalidArgument, match="kv_usage"):
                mc.heartbeat("e", 1, load=NodeLoad(kv_usage=bad))
        assert mc.heartbeat("e", 1, load=NodeLoad(queue_len=1, kv_usage=1.0)).known


def test_an_engine_namespace_travels_and_rebuilds_the_connectors_keys(master: MasterServer) -> None:
    """The router rebuilds a request's namespace from the engine's registration with the same function the
    engine's connector uses (B30/B31: one key function), so a router's peek sees the engine's blocks."""
    from kvpool.client import EngineNamespace
    from kvpool.hashing import hash_blocks
    from kvpool.types import KVLayout
    from kvpool.vllm.identity import Namespaces

    layout = KVLayout.from_fingerprint(DEFAULT_LAYOUT)
    engine = Namespaces(model_id="m", weights_version="w1", layout=layout, engine="vllm-0.32.0-cpu-vec")
    with MasterClient(master.address) as mc:
        mc.register_node(
            NodeInfo("e", "vllm-prefill", "", "", 1, "http://127.0.0.1:9", engine.base),
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=DEFAULT_LAYOUT,
        )
        got = {n.node.node_id: n.node.engine_namespace for n in mc.list_nodes()}["e"]
    assert got == engine.base
    assert isinstance(got, EngineNamespace)
    tokens = list(range(4 * layout.block_size))
    for salt in ("", "tenant-a"):
        mine = engine.namespace(cache_salt=salt, lora_path=None)
        assert got.namespace(salt).digest() == mine.digest()
        ours = got.namespace(salt).digest()
        assert hash_blocks(ours, tokens, layout.block_size) == hash_blocks(
            mine.digest(), tokens, layout.block_size
        )
    assert got.namespace("a").digest() != got.namespace("b").digest()


@pytest.mark.parametrize(
    ("role", "engine_ns", "expected"),
    [
        ("prefill", ("m", "w", DEFAULT_LAYOUT, "e"), "only vLLM engines register an engine_namespace"),
        ("vllm", ("", "w", DEFAULT_LAYOUT, "e"), "engine_namespace.model_id must be non-empty"),
        ("vllm", ("m", "w", "kv1:float16:b16:l2:h2:d8", "e"), "differs from the registration's layout"),
        ("vllm", ("m" * 300, "w", DEFAULT_LAYOUT, "e"), "engine_namespace.model_id"),
    ],
)
def test_a_bad_engine_namespace_is_invalid_argument(
    master: MasterServer, role: str, engine_ns: tuple[str, str, str, str], expected: str
) -> None:
    from kvpool.client import EngineNamespace

    with MasterClient(master.address) as mc, pytest.raises(InvalidArgument, match=expected):
        mc.register_node(
            NodeInfo("e", role, "", "", 1, "", EngineNamespace(*engine_ns)),
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=DEFAULT_LAYOUT,
        )
