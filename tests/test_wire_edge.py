"""One edge where requests leave a process: outgoing gRPC calls to kvpool's services (a generated `...Stub`)
are made only in `kvpool/client/`. Exceptions: the benchmarks that measure the wire without the client's
overhead on purpose (`kvpool/bench`), and the server plumbing's own health probe (`kvpool/rpc`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvpool", "prefill_node", "decode_node", "transfer")
ALLOWED = ("kvpool/client/", "kvpool/bench/", "kvpool/rpc/", "kvpool/v1/")


def stub_uses(source: str) -> list[str]:
    """The generated stubs `source` names ("pb_grpc.StoreStub", "StoreStub" imported by name)."""
    tree = ast.parse(source)
    grpc_modules: set[str] = set()  # local names bound to a *_pb2_grpc module
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            grpc_modules |= {a.asname or a.name for a in node.names if a.name.endswith("_pb2_grpc")}
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name.endswith("_pb2_grpc"):
                    grpc_modules.add(a.asname or a.name)
                elif (node.module or "").endswith("_pb2_grpc") and a.name.endswith("Stub"):
                    found.append(a.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.endswith("Stub")
            and isinstance(node.value, ast.Name)
            and node.value.id in grpc_modules
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_check_sees_a_stub() -> None:
    assert stub_uses("from kvpool.v1 import kvpool_pb2_grpc as g\nx = g.StoreStub(ch)\n") == ["g.StoreStub"]
    assert stub_uses("from kvpool.v1.kvpool_pb2_grpc import DecodeStub\n") == ["DecodeStub"]
    assert stub_uses("import kvpool.v1.kvpool_pb2_grpc as g\ng.add_StoreServicer_to_server(s, srv)\n") == []


def test_outgoing_calls_leave_only_through_kvpool_client() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(ALLOWED):
                continue
            uses = stub_uses(path.read_text())
            if uses:
                offenders.append(f"{rel}: {', '.join(sorted(set(uses)))}")
    assert not offenders, "gRPC stubs outside kvpool/client/ (add the call to kvpool.client):\n" + "\n".join(
        offenders
    )
