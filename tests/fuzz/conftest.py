"""One live cluster for every fuzz in this package: master, a store node, a prefill and a decode node (the
small embedded model) and a router, real processes on 127.0.0.1 ephemeral ports (limits: `cluster.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from kvpool.cluster.local import LocalCluster, LocalClusterSpec  # noqa: E402
from kvpool.cluster.process import RoleProcess  # noqa: E402
from kvpool.router.model_info import ModelInfo  # noqa: E402
from tests.fuzz.cluster import BLOCK, MAX_NEW, MAX_PROMPT, SEGMENT, Cases  # noqa: E402
from tests.fuzz.grpc_fuzz import Servers, connect  # noqa: E402


@pytest.fixture(scope="package")
def cases() -> Cases:
    return Cases()


@pytest.fixture(scope="package")
def model() -> ModelInfo:
    return ModelInfo.load(None, block_size=BLOCK)


@pytest.fixture(scope="package")
def cluster(model: ModelInfo) -> Iterator[LocalCluster]:
    spec = LocalClusterSpec(
        layout=model.layout.fingerprint(), num_stores=1, num_prefill=1, num_decode=1, block_size=BLOCK,
        segment_size=SEGMENT, heartbeat_timeout_ms=30_000,
        extra_env={"KVPOOL_MAX_PROMPT_TOKENS": str(MAX_PROMPT)},
    )  # fmt: skip
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="package")
def router(cluster: LocalCluster) -> str:
    """The router's base URL (`http://host:port`)."""
    env = dict(os.environ) | {
        "KVPOOL_MAX_PROMPT_TOKENS": str(MAX_PROMPT),
        "KVPOOL_MAX_TOKENS_LIMIT": str(MAX_NEW),
    }
    proc = RoleProcess(
        "router",
        ["router", "--master", cluster.master_address, "--port", "0"],
        log_path=cluster.log_dir / "router.log",
        env=env,
    )
    cluster.processes.append(proc)  # stopped with the cluster
    proc.wait_ready(60)
    return f"http://{proc.info['http_address']}"


@pytest.fixture(scope="package")
def servers(cluster: LocalCluster) -> Iterator[Servers]:
    """Channels to the master, the store, the prefill and the decode node (baselines taken first)."""
    s = connect(cluster)
    try:
        yield s
    finally:
        s.close()
