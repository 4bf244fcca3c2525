"""`kvpool.vllm.settings.ConnectorSettings.from_extra`: vLLM's `kv_connector_extra_config`, validated."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.errors import InvalidArgument
from kvpool.vllm.settings import ConnectorSettings


def test_a_minimal_config_takes_the_defaults() -> None:
    s = ConnectorSettings.from_extra({"master": "127.0.0.1:5"})
    assert s.master == "127.0.0.1:5"
    assert s.node_id == ""
    assert s.num_replicas == 1
    assert s.load_async is False and s.save_decode_blocks is True
    assert s.publish_max_bytes == 256 << 20
    with pytest.raises(Exception, match="frozen"):
        s.master = "127.0.0.1:6"  # type: ignore[misc]


def test_every_key_is_accepted() -> None:
    extra: dict[str, Any] = {
        "master": "[::1]:50051",
        "node_id": "vllm-a",
        "lease_ttl_ms": 5000,
        "pull_timeout_s": 3.5,
        "match_wait_s": 0.25,
        "pd_wait_s": 0.5,
        "num_replicas": 2,
        "cost_margin": 0.0,
        "publish_max_bytes": 1 << 20,
        "load_async": True,
        "save_decode_blocks": False,
        "flops_per_s": 1e12,
        "master_timeout_s": 1.0,
        "role": "decode",
        "url": "http://127.0.0.1:8100",
    }
    s = ConnectorSettings.from_extra(extra)
    assert s.model_dump() == extra
    assert set(extra) == set(ConnectorSettings.model_fields)


@pytest.mark.parametrize("extra", [None, {}])
def test_the_master_is_required(extra: dict[str, Any] | None) -> None:
    with pytest.raises(InvalidArgument, match=r"^kv_connector_extra_config: master: Field required$"):
        ConnectorSettings.from_extra(extra)


def test_an_unknown_key_is_refused_by_name() -> None:
    with pytest.raises(InvalidArgument, match=r"kv_connector_extra_config: .*mastr_timeout_s: Extra inputs"):
        ConnectorSettings.from_extra({"master": "127.0.0.1:5", "mastr_timeout_s": 1.0})


@pytest.mark.parametrize("master", ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", ":5", "host:port", ""])
def test_a_bad_master_is_refused_by_name(master: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^kv_connector_extra_config: master: .*HOST:PORT") as info:
        ConnectorSettings.from_extra({"master": master})
    assert isinstance(info.value, ValueError)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # pydantic's trace is not chained


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lease_ttl_ms", 0),
        ("pull_timeout_s", -1.0),
        ("num_replicas", 0),
        ("publish_max_bytes", 0),
        ("cost_margin", -0.5),
        ("num_replicas", "two"),
        ("role", "both-ways"),
        ("url", "127.0.0.1:8100"),
        ("url", "http://127.0.0.1:8100/v1"),
        ("url", "http://127.0.0.1"),
    ],
)
def test_a_bad_value_is_refused_by_name(key: str, value: Any) -> None:
    with pytest.raises(InvalidArgument, match=rf"^kv_connector_extra_config: {key}: "):
        ConnectorSettings.from_extra({"master": "127.0.0.1:5", key: value})


def test_every_bad_key_is_named_once() -> None:
    with pytest.raises(InvalidArgument) as info:
        ConnectorSettings.from_extra({"master": "nope", "lease_ttl_ms": 0, "typo": 1})
    message = str(info.value)
    parts = message.removeprefix("kv_connector_extra_config: ").split("; ")
    assert sorted(p.split(":")[0] for p in parts) == ["lease_ttl_ms", "master", "typo"], message


@pytest.mark.parametrize(
    ("role", "master_role"), [("both", "vllm"), ("prefill", "vllm-prefill"), ("decode", "vllm-decode")]
)
def test_the_role_maps_to_the_masters_role(role: str, master_role: str) -> None:
    s = ConnectorSettings.from_extra({"master": "127.0.0.1:5", "role": role, "url": "https://h:8000/"})
    assert s.master_role == master_role and s.url == "https://h:8000"
