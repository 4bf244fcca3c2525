"""A version switch to a version nothing uses is refused unless forced (issue #26, B32 kind: input is
refused, not silently reinterpreted): `SetModelVersion` over real gRPC (an in-process master on
127.0.0.1:0) and `kvpool admin set-version` (typer's CliRunner), with the counts each answer reports."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from kvpool.cli.main import app
from kvpool.client import EngineNamespace, MasterClient, NodeInfo
from kvpool.errors import FailedPrecondition, VersionFenced
from kvpool.master.server import MasterServer, serve
from kvpool.master.settings import MasterSettings
from kvpool.rpc import PROTOCOL_VERSION
from tests.test_master_bounded_state import FP, chain, put


@pytest.fixture
def master() -> Iterator[MasterServer]:
    server = serve(MasterSettings(port=0, bind_host="127.0.0.1", metrics=False))
    try:
        yield server
    finally:
        server.stop()


def test_a_version_nothing_uses_is_refused_naming_model_version_and_versions_in_use(
    master: MasterServer,
) -> None:
    with MasterClient(master.address) as c:
        v1, _ = c.register_namespace("llm", "v1", FP)
        c.register_namespace("llm", "v1", FP, cache_salt="tenant-b")
        put(master.master, v1, chain(v1, 0, 3))
        with pytest.raises(FailedPrecondition) as info:
            c.set_model_version("llm", "v1-typo")
        assert not isinstance(info.value, VersionFenced)
        text = str(info.value)
        assert "'llm'" in text and "'v1-typo'" in text and "in use: v1" in text and "force" in text
        with pytest.raises(FailedPrecondition, match="in use: none"):
            c.set_model_version("other-model", "v1")  # v1 of another model does not count
        assert c.match(v1, chain(v1, 0, 3)).num_matched == 3  # nothing changed
        assert master.master.namespaces.active_version("llm") == "v1"

        assert c.set_model_version("llm", "v2", force=True) == ("v1", 2, 3)  # forced: ahead of a rollout
        assert c.match(v1, chain(v1, 0, 3)).num_matched == 0
        assert c.set_model_version("llm", "v2") == ("v2", 0, 0)  # already active: a no-op, not refused
        assert c.set_model_version("llm", "v1") == ("v2", 0, 0)  # v1 is registered: allowed back


def test_a_version_a_live_engine_serves_is_allowed_without_force(master: MasterServer) -> None:
    with MasterClient(master.address) as c:
        c.register_namespace("eng", "w1", FP)
        with pytest.raises(FailedPrecondition, match="'w2'"):
            c.set_model_version("eng", "w2")
        c.register_node(
            NodeInfo(
                "e", "vllm-prefill", "", "", 1, "http://127.0.0.1:9", EngineNamespace("eng", "w2", FP, "vllm")
            ),
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=FP,
        )
        assert c.set_model_version("eng", "w2") == ("w1", 1, 0)


def test_admin_set_version_refuses_a_typo_and_force_sets_it_with_counts(master: MasterServer) -> None:
    with MasterClient(master.address) as c:
        v1, _ = c.register_namespace("cli-model", "v1", FP)
    put(master.master, v1, chain(v1, 0, 2))
    runner = CliRunner()
    base = ["admin", "--master", master.address, "set-version", "--model", "cli-model"]

    typo = runner.invoke(app, [*base, "--version", "v1-typo"])
    assert typo.exit_code == 1, typo.output
    assert "FailedPrecondition" in typo.output and "'v1-typo'" in typo.output and "in use: v1" in typo.output
    assert master.master.namespaces.active_version("cli-model") == "v1"

    forced = runner.invoke(app, [*base, "--version", "v2", "--force", "--json"])
    assert forced.exit_code == 0, forced.output
    answer = json.loads(forced.stdout)
    assert answer["previous_version"] == "v1" and answer["version"] == "v2"
    assert answer["namespaces_invalidated"] == 1 and answer["blocks_unreachable"] == 2
    assert answer["registered_versions"] == ["v1"]

    table = runner.invoke(app, [*base, "--version", "v1"])  # registered: no --force needed
    assert table.exit_code == 0, table.output
    assert "namespaces_invalidated" in table.stdout and "blocks_unreachable" in table.stdout
    assert "warning" not in table.output

    ahead = runner.invoke(app, [*base, "--version", "v3", "--force"])  # the table says what it means
    assert ahead.exit_code == 0, ahead.output
    assert "warning: no node has registered 'cli-model' at version 'v3' (registered: v1)" in ahead.stderr


def test_admin_invalidate_reports_the_blocks_it_made_unreachable(master: MasterServer) -> None:
    with MasterClient(master.address) as c:
        ns, _ = c.register_namespace("inv-model", "v1", FP)
    put(master.master, ns, chain(ns, 0, 4))
    out = CliRunner().invoke(
        app, ["admin", "--master", master.address, "invalidate", "--namespace", ns.hex(), "--json"]
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == {"namespace": ns.hex(), "invalidated": True, "blocks_unreachable": 4}
