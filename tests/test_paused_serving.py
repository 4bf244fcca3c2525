"""Paused, not killed (issue #39, slow: real processes): SIGSTOP a member under greedy serving traffic
through the router, SIGCONT it, and check every answer against a cold run of the model.

`kvpool up -c` of three masters on an etcd, a store, two prefill nodes, a decode node and the router (the
cluster of tests/test_ha_serving.py, with /metrics ports). Each case: 0 failed requests, 0 wrong tokens,
hits back within the lease TTL + 3 s of the pause's end (for the leader: of the new leader).

- the leading master, for twice the lease TTL: a standby leads; the old one, resumed, finds it was
  deposed, stands by, and no order at its old epoch is taken by the store after the new leader won
  (`deposed_orders_accepted`, from the store's per-epoch order counter);
- the store, for 10 s mid-transfer: its replicas leave the matches once it is silent (recomputed), its
  hits come back after it answers again;
- etcd, for 15 s: no election; the leader steps down and serves reads; a leader again afterwards.

The figures are printed, and written as JSON to `KVPOOL_PAUSED_JSON` when set (docs/bench_faults.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.client import MasterClient
from kvpool.rpc.security import security
from tests.capabilities import require_etcd, require_ucx
from tests.test_ha_serving import (
    BACKOFF_S,
    TTL_S,
    Cluster,
    Traffic,
    _hit_rate,
    _pid_listening,
    _status,
    _wait,
)
from tests.test_up_supervised import _Up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

FIGURES: dict[str, dict[str, float]] = {}


def _free_ports(n: int) -> int:
    """The first of `n` consecutive ports free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        try:
            socks = []
            for p in range(first, first + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
        return first
    raise AssertionError("no free consecutive ports")


def _spec(master_metrics: int, store_metrics: int) -> str:
    return f"""
[cluster]
block_size = 16
masters = 3
restart_backoff_s = {BACKOFF_S}
[master]
port = 0
metrics_port = {master_metrics}
[store]
count = 1
segment_size = "64MiB"
metrics_port = {store_metrics}
[prefill]
count = 2
[router]
port = 0
policy = "round-robin"
"""


def _samples(port: int) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _accepted_at(port: int, epoch: int) -> float:
    """The store's orders taken at leader `epoch`."""
    return sum(
        v
        for n, lab, v in _samples(port)
        if n == "kvpool_store_orders_accepted_total" and lab.get("epoch") == str(epoch)
    )


def _epoch(address: str) -> int:
    with MasterClient(address, timeout_s=2.0) as c:
        return int(c.masters().epoch)


@pytest.fixture(scope="module")
def paused(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, int, int]]:
    require_etcd()
    require_ucx()
    master_metrics, store_metrics = _free_ports(3), _free_ports(1)
    spec = Path(tmp_path_factory.mktemp("paused")) / "cluster.toml"
    spec.write_text(_spec(master_metrics, store_metrics))
    up = _Up(spec)
    tls = pytest.MonkeyPatch()
    try:
        up.wait_line("Ctrl-C stops everything", 240)
        for name, value in up.tls_env().items():
            tls.setenv(name, value)
        security.cache_clear()
        at = up.endpoints()
        masters = [at[f"master{i}"] for i in range(3)]
        c = Cluster(up, f"http://{at['router']}", masters, int(at["etcd"].rsplit(":", 1)[1]))
        _wait(lambda: bool(c.leader()), 20, "one leader", up)
        yield c, master_metrics, store_metrics
    finally:
        out = up.stop()
        tls.undo()
        security.cache_clear()
        if os.environ.get("KVPOOL_PAUSED_JSON") and FIGURES:
            Path(os.environ["KVPOOL_PAUSED_JSON"]).write_text(json.dumps(FIGURES, indent=2) + "\n")
    assert up.proc.returncode == 0, out[-3000:]


def _steady(traffic: Traffic, up: _Up, timeout_s: float = 60.0) -> float:
    """Wait until the last 4 repeated prompts hit (a publish breaker opened by an earlier case may still
    be cooling down); returns when (monotonic)."""
    _wait(
        lambda: len(traffic.again) >= 4 and _hit_rate(traffic.again[-4:]) > 0.5, timeout_s, "steady hits", up
    )
    return time.monotonic()


def _hits_back_s(traffic: Traffic, level: float, t0: float, window: int = 3) -> float | None:
    after = traffic.since(t0)
    return next((a.at_s - t0 for k, a in enumerate(after[: len(after) - window + 1])
                 if _hit_rate(after[k : k + window]) >= 0.9 * level), None)  # fmt: skip


def _record(name: str, traffic: Traffic, back_s: float | None, **more: float) -> None:
    answers = traffic.cold + traffic.again  # after `traffic.check()`: 0 failed, 0 wrong
    FIGURES[name] = {
        "requests": len(answers),
        "failed": 0,
        "wrong": 0,
        "hits_back_s": -1.0 if back_s is None else round(back_s, 2),
        **more,
    }
    print(f"\n{name}: {FIGURES[name]}")


def test_pause_the_leader_twice_the_lease_ttl(paused: tuple[Cluster, int, int]) -> None:
    cluster, master_metrics, store_metrics = paused
    up = cluster.up
    leader = cluster.leader()
    e1 = _epoch(leader)
    standbys = [a for a in cluster.masters if a != leader]
    pid = _pid_listening(up, int(leader.rsplit(":", 1)[1]))
    traffic = Traffic(cluster.url, "leader-pause")
    try:
        time.sleep(8.0)
        t_pause = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait(lambda: any(_status(a)[0] == "leader" for a in standbys), TTL_S + 4, "a standby leads", up)
            t_lead = time.monotonic()
            new_leader = next(a for a in standbys if _status(a)[0] == "leader")
            e2 = _epoch(new_leader)
            taken_at_e1 = _accepted_at(store_metrics, e1)  # from now on, e1's orders are a deposed leader's
            time.sleep(max(0.0, t_pause + 2 * TTL_S - time.monotonic()))
        finally:
            os.kill(pid, signal.SIGCONT)
        _wait(lambda: _status(leader) == ("standby", new_leader), 15, "the resumed master stands by", up)
        time.sleep(max(0.0, t_lead + 12.0 - time.monotonic()))
    finally:
        traffic.stop()
    traffic.check()
    deposed = _accepted_at(store_metrics, e1) - taken_at_e1
    level = _hit_rate(traffic.since(0.0, t_pause)[2:])
    back_s = _hits_back_s(traffic, level, t_lead)
    _record(
        "leader_paused_2x_ttl",
        traffic,
        back_s,
        deposed_orders_accepted=deposed,
        epoch_before=e1,
        epoch_after=e2,
    )
    assert e2 > e1
    assert deposed == 0
    assert level > 0.5, level
    assert back_s is not None and back_s <= TTL_S + 3, back_s


def test_pause_the_store_10_s_mid_transfer(paused: tuple[Cluster, int, int]) -> None:
    cluster, _, store_metrics = paused
    up = cluster.up
    _wait(lambda: bool(cluster.leader()), 20, "one leader", up)
    pid = up.role_pid("store0")
    traffic = Traffic(cluster.url, "store-pause")
    try:
        t_steady = _steady(traffic, up)
        time.sleep(4.0)
        t_pause = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(10.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        t_cont = time.monotonic()
        time.sleep(12.0)
    finally:
        traffic.stop()
    traffic.check()
    level = _hit_rate(traffic.since(t_steady, t_pause))
    back_s = _hits_back_s(traffic, level, t_cont)
    _record(
        "store_paused_10s",
        traffic,
        back_s,
        hit_rate_paused=round(_hit_rate(traffic.since(t_pause + 3, t_cont)), 2),
    )
    assert level > 0.5, level
    assert back_s is not None and back_s <= TTL_S + 3, back_s


def test_pause_etcd_15_s(paused: tuple[Cluster, int, int]) -> None:
    cluster, _, _ = paused
    up = cluster.up
    _wait(lambda: bool(cluster.leader()), 20, "one leader", up)
    pid = _pid_listening(up, cluster.etcd_port)
    traffic = Traffic(cluster.url, "etcd-pause")
    try:
        t_steady = _steady(traffic, up)
        time.sleep(4.0)
        t_pause = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait(
                lambda: any(_status(a)[0] == "deposed" for a in cluster.masters),
                TTL_S + 4,
                "the leader steps down",
                up,
            )
            time.sleep(max(0.0, t_pause + 15.0 - time.monotonic()))
        finally:
            os.kill(pid, signal.SIGCONT)
        t_cont = time.monotonic()
        _wait(lambda: bool(cluster.leader()), 3 * TTL_S, "a leader again", up)
        time.sleep(12.0)
    finally:
        traffic.stop()
    traffic.check()
    level = _hit_rate(traffic.since(t_steady, t_pause))
    back_s = _hits_back_s(traffic, level, t_cont)
    _record(
        "etcd_paused_15s",
        traffic,
        back_s,
        hit_rate_paused=round(_hit_rate(traffic.since(t_pause, t_cont)), 2),
    )
    assert level > 0.5, level
    assert back_s is not None and back_s <= TTL_S + 3, back_s
