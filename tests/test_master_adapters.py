"""Adapters are content; reloading one is an operation (issue #26 item 3, B01): a real in-process master
over gRPC, blocks in its index, and `kvpool admin adapter` (typer's CliRunner)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpool.cli.main import app
from kvpool.client import MasterClient
from kvpool.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, VersionFenced
from kvpool.master.server import MasterServer, serve
from kvpool.master.settings import MasterSettings
from kvpool.vllm.identity import directory_digest
from tests.test_master_bounded_state import FP, chain, put

A, B, C = "a" * 32, "b" * 32, "c" * 32


def serve_master(**kw: object) -> MasterServer:
    return serve(MasterSettings(port=0, bind_host="127.0.0.1", metrics=False, **kw))  # type: ignore[arg-type]


@pytest.fixture
def master() -> Iterator[MasterServer]:
    server = serve_master()
    try:
        yield server
    finally:
        server.stop()


def flush_epoch(m: MasterServer) -> int:
    return m.master.namespaces.flush_epoch  # what every heartbeat answer carries (service.Heartbeat)


def test_reload_makes_the_old_adapters_kv_unreachable_at_once_and_counts_it(master: MasterServer) -> None:
    with MasterClient(master.address) as c:
        ns_a, _ = c.register_namespace("llm", "v1", FP, adapter_digest=A)
        ns_a2, _ = c.register_namespace("llm", "v1", FP, adapter_digest=A, cache_salt="t2")
        base, _ = c.register_namespace("llm", "v1", FP)
        put(master.master, ns_a, chain(ns_a, 0, 3))
        put(master.master, ns_a2, chain(ns_a2, 0, 2), slot0=10)
        put(master.master, base, chain(base, 0, 1), slot0=20)
        assert c.register_adapter("llm", "support", A) is True
        assert c.register_adapter("llm", "support", A) is False  # idempotent
        assert c.match(ns_a, chain(ns_a, 0, 3)).num_matched == 3
        epoch = flush_epoch(master)

        assert c.reload_adapter("llm", "support", B) == (A, 2, 5)
        assert c.match(ns_a, chain(ns_a, 0, 3)).num_matched == 0
        assert c.match(ns_a2, chain(ns_a2, 0, 2)).num_matched == 0
        assert c.match(base, chain(base, 0, 1)).num_matched == 1  # the base model is untouched
        assert flush_epoch(master) == epoch + 1  # serving nodes drop their node-local tiers
        with pytest.raises(VersionFenced):  # a node still on the old adapter publishing is refused
            c.reserve(ns_a, None, chain(ns_a, 0, 1))
        ns_a_again, _ = c.register_namespace("llm", "v1", FP, adapter_digest=A)
        assert ns_a_again == ns_a and not master.master.namespaces.is_active(ns_a)

        ns_b, _ = c.register_namespace("llm", "v1", FP, adapter_digest=B)
        assert master.master.namespaces.is_active(ns_b)
        put(master.master, ns_b, chain(ns_b, 0, 2), slot0=30)
        assert c.match(ns_b, chain(ns_b, 0, 2)).num_matched == 2
        [info] = c.list_adapters("llm")
        assert (info.name, info.digest, info.num_namespaces, info.num_blocks) == ("support", B, 1, 2)
        assert c.reload_adapter("llm", "support", B) == (B, 0, 0)  # same weights: nothing happens

        assert c.unload_adapter("llm", "support") == (B, 1, 2)
        assert c.match(ns_b, chain(ns_b, 0, 2)).num_matched == 0
        assert c.list_adapters() == []
        with pytest.raises(NotFound, match="'support'"):
            c.unload_adapter("llm", "support")

        assert c.register_adapter("llm", "support", A) is True  # rolled back: A serves again, empty
        assert master.master.namespaces.is_active(ns_a)
        assert c.match(ns_a, chain(ns_a, 0, 3)).num_matched == 0


def test_a_digest_another_name_still_uses_stays_served(master: MasterServer) -> None:
    with MasterClient(master.address) as c:
        ns_a, _ = c.register_namespace("llm", "v1", FP, adapter_digest=A)
        put(master.master, ns_a, chain(ns_a, 0, 2))
        c.register_adapter("llm", "one", A)
        c.register_adapter("llm", "two", A)
        c.register_adapter("other", "one", A)  # another model's adapter never fences llm's namespaces
        assert c.reload_adapter("llm", "one", B) == (A, 0, 0)
        assert c.match(ns_a, chain(ns_a, 0, 2)).num_matched == 2
        assert c.unload_adapter("llm", "two") == (A, 1, 2)
        assert c.match(ns_a, chain(ns_a, 0, 2)).num_matched == 0
        with pytest.raises(AlreadyExists, match="reload"):
            c.register_adapter("llm", "one", C)


@pytest.mark.parametrize("bad", ["my-lora", "A" * 32, "a" * 31, "a" * 33, "z" * 32])
def test_an_adapter_value_that_is_not_a_digest_is_invalid_argument(master: MasterServer, bad: str) -> None:
    with MasterClient(master.address) as c:
        with pytest.raises(InvalidArgument, match="adapter_digest must be the adapter's content digest"):
            c.register_namespace("llm", "v1", FP, adapter_digest=bad)
        with pytest.raises(InvalidArgument, match="digest must be"):
            c.register_adapter("llm", "x", bad)
        c.register_adapter("llm", "x", A)
        with pytest.raises(InvalidArgument, match="digest must be"):
            c.reload_adapter("llm", "x", bad)
        with pytest.raises(InvalidArgument, match="non-empty"):
            c.register_adapter("", "x", A)
        with pytest.raises(InvalidArgument, match="non-empty"):
            c.unload_adapter("llm", "")
        with pytest.raises(InvalidArgument, match="longer than"):
            c.register_adapter("llm", "n" * 100_000, A)
        with pytest.raises(NotFound):
            c.reload_adapter("llm", "never-registered", B)


def test_the_number_of_adapters_is_capped_naming_the_setting() -> None:
    server = serve_master(max_adapters=2)
    try:
        with MasterClient(server.address) as c:
            ns_a, _ = c.register_namespace("llm", "v1", FP, adapter_digest=A)
            c.register_adapter("llm", "one", A)
            c.register_adapter("llm", "two", B)
            with pytest.raises(ResourceExhausted, match="max_adapters"):
                c.register_adapter("llm", "three", C)
            c.unload_adapter("llm", "two")
            c.register_adapter("llm", "three", C)
            # fences are bounded too: past max_adapters the oldest is forgotten (its digest serves again)
            c.reload_adapter("llm", "one", "d" * 32)
            assert not server.master.namespaces.is_active(ns_a)
            c.reload_adapter("llm", "three", "e" * 32)  # fences C, forgets B's fence
            assert not server.master.namespaces.is_active(ns_a)
            c.reload_adapter("llm", "one", "f" * 32)  # fences d, forgets A's fence
            assert server.master.namespaces.is_active(ns_a)
            assert len(server.master.namespaces.adapters) == 2
    finally:
        server.stop()


def test_admin_adapter_commands_print_their_counts(master: MasterServer, tmp_path: Path) -> None:
    weights = tmp_path / "lora"
    weights.mkdir()
    (weights / "adapter_model.safetensors").write_bytes(b"weights v1")
    d1 = directory_digest(weights)
    with MasterClient(master.address) as c:
        ns1, _ = c.register_namespace("cli-model", "v1", FP, adapter_digest=d1)
    put(master.master, ns1, chain(ns1, 0, 4))
    runner = CliRunner()
    base = ["admin", "--master", master.address, "adapter"]
    who = ["--model", "cli-model", "--name", "sql"]

    out = runner.invoke(app, [*base, "register", *who, "--path", str(weights), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {"model": "cli-model", "name": "sql", "digest": d1, "created": True}

    (weights / "adapter_model.safetensors").write_bytes(b"weights v2")
    d2 = directory_digest(weights)
    out = runner.invoke(app, [*base, "reload", *who, "--path", str(weights), "--json"])
    assert out.exit_code == 0, out.output
    r = json.loads(out.output)
    assert (r["previous_digest"], r["digest"], r["namespaces_invalidated"], r["blocks_invalidated"]) == (
        d1,
        d2,
        1,
        4,
    )

    out = runner.invoke(app, [*base, "list"])
    assert out.exit_code == 0 and d2 in out.output and "sql" in out.output, out.output
    out = runner.invoke(app, [*base, "unload", *who])
    assert out.exit_code == 0 and "blocks_invalidated" in out.output, out.output

    bad = runner.invoke(app, [*base, "register", *who, "--digest", "sql-v1"])
    assert bad.exit_code == 2 and "--digest" in bad.output, bad.output
    gone = runner.invoke(app, [*base, "unload", *who])
    assert gone.exit_code == 1 and "NotFound" in gone.output, gone.output
