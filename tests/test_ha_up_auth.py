"""A secured `kvpool up` with `masters = 2` runs its etcd with TLS, client certificates and auth (docs/ha.md,
docs/security.md): a process without the masters' certificate cannot reach the election's keys, the
masters elect with it and their password, and the keys and passwords are in 0600 files of the run directory
(slow: a real `kvpool up`)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvpool.master.ha.endpoints import EtcdAuth
from tests.capabilities import require_etcd
from tests.test_up_supervised import _Up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SPEC = """
[cluster]
block_size = 16
masters = 2
[master]
port = 0
[store]
count = 1
segment_size = "64MiB"
[prefill]
count = 1
[router]
enabled = false
"""


class _SecuredUp(_Up):
    """`kvpool up -c spec`, secured (no `--insecure`)."""

    def __init__(self, spec: Path) -> None:  # the parent's, without `--insecure` and this process's KVPOOL_*
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")} | {"PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self.lines: list[str] = []
        pipe = self.proc.stdout
        assert pipe is not None
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(pipe.readline, "")), daemon=True)
        self.reader.start()


def _get_or_put(port: int, auth: EtcdAuth, *, put: bytes = b"") -> bytes:
    """The leader key (after writing `put` there), as a client reaching etcd as `auth` says."""
    from kvpool.master.ha.etcd_client import EtcdClient

    async def run() -> bytes:
        c = EtcdClient("127.0.0.1", port, auth, 5.0)
        try:
            if put:
                await c.put(b"/kvpool/master/leader", put)
            got = await c.get(b"/kvpool/master/leader")
            return b"" if got is None else bytes(got.value)
        finally:
            await c.close()

    return asyncio.run(asyncio.wait_for(run(), 10))


def test_a_secured_up_s_etcd_takes_only_the_masters_over_tls_with_auth(tmp_path: Path) -> None:
    require_etcd()
    spec = tmp_path / "cluster.toml"
    spec.write_text(SPEC)
    up = _SecuredUp(spec)
    try:
        up.wait_line("Ctrl-C stops everything", 240)
        text = "".join(up.lines)
        found = re.search(r"etcd\s+127\.0\.0\.1:(\d+)\s+\(data: (\S+)/etcd\)", text)
        assert found, up.tail()
        port, run_dir = int(found.group(1)), Path(found.group(2))
        password_file = run_dir / "etcd_password"
        assert password_file.stat().st_mode & 0o777 == 0o600
        assert (run_dir / "etcd_root_password").stat().st_mode & 0o777 == 0o600
        tls_dir = run_dir / "etcd-tls"
        ca, cert, key = (str(tls_dir / n) for n in ("ca.pem", "client.pem", "client.key"))
        assert all(Path(k).stat().st_mode & 0o077 == 0 for k in (key, tls_dir / "server.key"))
        assert not (tls_dir / "ca.key").exists()  # the CA signs once: its key is gone
        password = password_file.read_text().strip()
        # with the password but in plain text, or over TLS without the client certificate: no answer
        for without in (EtcdAuth("kvpool", password), EtcdAuth("kvpool", password, ca_file=ca)):
            with pytest.raises(Exception):  # noqa: B017 - refused at the connection, in grpc's words
                _get_or_put(port, without, put=b"127.0.0.1:1")
        masters = re.findall(r"master\d\s+(127\.0\.0\.1:\d+)", text)
        assert len(masters) == 2, up.tail()
        assert f"admin CLI: kvpool admin --master {','.join(masters)} status" in text, up.tail()
        auth = EtcdAuth("kvpool", password, ca, cert, key)
        leader = _get_or_put(port, auth)  # the masters elected over TLS with the password
        assert leader.split(b" ")[0].decode() in masters, leader
    finally:
        out = up.stop()
    assert up.proc.returncode == 0, out[-3000:]
