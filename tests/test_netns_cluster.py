"""A cluster across four Linux network namespaces ("hosts") on one private subnet (issues #11, #12).

ns 0: master + store0; ns 1: store1 + prefill0; ns 2: decode0 + router; ns 3: store2 alone (the one cut
off the network in the fault test). Each namespace is joined by a
veth pair to a bridge in a hub namespace; the addresses exist only inside them (`NamespaceGroup`). Every
role is its own `kvpool <role> --listen ADDR --master HOST:PORT` process under `ip netns exec`, with
`UCX_TLS=tcp` (UCX would otherwise see one host and use shared memory) and no node-local tier, so every
reuse is a pull over the veth links. HTTP to the router and `/metrics` scrapes run inside ns 2.

Root only (skipped with the reason otherwise); namespaces and processes are torn down even on failure;
names are pid-suffixed so parallel runs do not collide.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.bench.netns import NamespaceGroup, python_in_netns
from kvpool.cluster.process import RoleProcess
from tests.capabilities import require_netns, skip

pytestmark = pytest.mark.slow

BLOCK = 16
_FETCH = """
import json, sys, urllib.error, urllib.request
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode() if body else None,
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=120) as r:
        sys.stdout.write(r.read().decode())
except urllib.error.HTTPError as e:
    sys.exit(f"HTTP {e.code}: {e.read().decode()[:2000]}")
"""


class NetnsCluster:
    """The role processes of the test, each started in its namespace."""

    def __init__(self, group: NamespaceGroup, workdir: Path) -> None:
        self.group = group
        self.workdir = workdir
        self.procs: dict[str, RoleProcess] = {}
        self.model_id = ""
        self.env = dict(os.environ) | {
            "UCX_TLS": "tcp",
            "KVPOOL_LOCAL_TIER_BYTES": "0",
            "PYTHONFAULTHANDLER": "1",
        }

    def spawn(self, ns: int, name: str, args: list[str]) -> RoleProcess:
        with python_in_netns(self.group.names[ns], str(self.workdir)):
            proc = RoleProcess(name, args, log_path=self.workdir / f"{name}.log", env=self.env)
        self.procs[name] = proc
        return proc

    def fetch(self, ns: int, url: str, body: dict[str, Any] | None = None) -> str:
        """GET (or POST `body` as JSON) `url` from inside namespace `ns`; the response body."""
        cmd = [*self.group.exec_args(ns), sys.executable, "-c", _FETCH, url, json.dumps(body) if body else ""]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
        assert out.returncode == 0, f"{url}: {out.stderr[-2000:]}\n{self.logs()}"
        return out.stdout

    def logs(self) -> str:
        gone = [f"{n} exited {p.proc.poll()}" for n, p in self.procs.items() if not p.alive]
        return "\n".join([*gone, *(p.log_tail(60) for p in self.procs.values())])

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            with contextlib.suppress(Exception):  # keep stopping the others
                proc.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[NetnsCluster]:
    require_netns()
    pytest.importorskip("torch")
    from kvpool.router.model_info import ModelInfo

    layout = ModelInfo.load(None, block_size=BLOCK).layout.fingerprint()
    group = NamespaceGroup(4)
    try:
        group.open()
    except RuntimeError as exc:
        skip("netns", f"cannot create network namespaces here: {exc}")
    workdir = Path(tempfile.mkdtemp(prefix="kvpool-netns-"))
    c = NetnsCluster(group, workdir)
    a, b, cc, d = group.addresses
    try:
        master = c.spawn(0, "master", ["master", "--listen", a, "--port", "0", "--layout", layout,
                                       "--heartbeat-timeout-ms", "30000"])  # fmt: skip
        m = master.wait_ready(60)["grpc_address"]
        store = ["--grpc-port", "0", "--data-port", "0", "--segment-size", "32MiB", "--layout", layout]
        c.spawn(0, "store0", ["store", "--master", m, "--listen", a, "--node-id", "store0", *store])
        c.spawn(1, "store1", ["store", "--master", m, "--listen", b, "--node-id", "store1", *store])
        c.spawn(3, "store2", ["store", "--master", m, "--listen", d, "--node-id", "store2", *store])
        serving = ["--master", m, "--port", "0", "--block-size", str(BLOCK)]
        c.spawn(1, "prefill0", ["prefill", "--listen", b, "--node-id", "prefill0", *serving])
        c.spawn(2, "decode0", ["decode", "--listen", cc, "--node-id", "decode0", *serving])
        for proc in list(c.procs.values())[1:]:
            proc.wait_ready(180)
        c.spawn(2, "router", ["router", "--master", m, "--listen", cc, "--port", "0"]).wait_ready(60)
        yield c
    finally:
        c.stop()
        group.close()
        shutil.rmtree(workdir, ignore_errors=True)
        assert not set(group.names) & set(_netns_list()), "namespaces left behind"


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _complete(c: NetnsCluster, prompt: str, **extra: Any) -> dict[str, Any]:
    router = c.procs["router"].info["http_address"]
    body = {"model": c.model_id, "prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
    out: dict[str, Any] = json.loads(c.fetch(2, f"http://{router}/v1/completions", body))
    return out


def _link_read_bytes(c: NetnsCluster, name: str) -> dict[str, float]:
    """Bytes process `name` read per peer (its `/metrics`, scraped from inside namespace 2)."""
    role = c.procs[name].info["role"]
    text = c.fetch(2, f"http://{c.procs[name].info['metrics_address']}/metrics")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"kvpool_{role}_link_bytes_total" and s.labels["op"] == "read":
                out[s.labels["peer"]] = s.value
    return out


def test_requests_across_three_namespaces_hit_and_match_a_cold_reference(cluster: NetnsCluster) -> None:
    c = cluster
    assert c.procs["master"].info["grpc_address"].startswith(c.group.addresses[0] + ":")
    router = c.procs["router"].info["http_address"]
    assert router.startswith(c.group.addresses[2] + ":")
    c.model_id = json.loads(c.fetch(2, f"http://{router}/v1/models"))["data"][0]["id"]
    doc = "Store nodes keep KV blocks in CPU memory; prefill nodes publish them, decode nodes pull them. " * 4
    first = _complete(c, doc + "What do store nodes keep?")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(0.5)  # the publish commits right after the first token
    warm = _complete(c, doc + "Who pulls them?")
    cold = _complete(c, doc + "Who pulls them?", cache_salt=f"cold-{os.getpid()}")  # its own namespace
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= BLOCK * 8, (cached, c.logs())
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]  # greedy: hits change nothing
    # bytes crossed namespaces: decode (ns 2) pulled from store nodes in ns 0 and 1 over the veth links
    stores = {c.procs[n].info["data_address"] for n in ("store0", "store1", "store2")}
    decode_reads = _link_read_bytes(c, "decode0")
    assert set(decode_reads) <= stores and sum(decode_reads.values()) > 0, decode_reads
    prefill_reads = _link_read_bytes(c, "prefill0")
    assert set(prefill_reads) <= stores and sum(prefill_reads.values()) > 0, prefill_reads


def test_a_store_cut_off_the_network_costs_time_not_answers(cluster: NetnsCluster) -> None:
    """Namespace 3 (store2 alone) loses its link: pulls of its blocks time out and the nodes recompute
    exactly the missing span; every answer still equals a cold one. Then the link comes back."""
    c = cluster
    router = c.procs["router"].info["http_address"]
    c.model_id = json.loads(c.fetch(2, f"http://{router}/v1/models"))["data"][0]["id"]
    docs = [f"Document {i}: the pool spreads blocks over every store node it knows. " * 4 for i in range(4)]
    for doc in docs:  # publish: with one replica per block, some blocks of each document land on store2
        _complete(c, doc + "Warm up?")
    time.sleep(0.5)
    c.group.set_link(3, up=False)
    try:
        t0 = time.perf_counter()
        for i, doc in enumerate(docs):
            q = doc + f"Question {i}?"
            cut = _complete(c, q)
            cold = _complete(c, q, cache_salt=f"cold-cut-{os.getpid()}")
            assert cut["choices"][0]["text"] == cold["choices"][0]["text"], (i, c.logs())
        elapsed_s = time.perf_counter() - t0
    finally:
        c.group.set_link(3, up=True)
    print(f"\nstore cut off: {len(docs)} requests (+ cold references) answered right in {elapsed_s:.1f} s")
    after = _complete(c, docs[0] + "After the cut?")
    assert (
        after["choices"][0]["text"]
        == _complete(c, docs[0] + "After the cut?", cache_salt=f"cold-after-{os.getpid()}")["choices"][0][
            "text"
        ]
    )
