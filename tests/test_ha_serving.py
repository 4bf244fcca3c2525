"""Serving traffic through a failover of masters in high availability (slow: real processes).

`kvpool up -c` of a spec with `[cluster] masters = 3` starts an etcd, three masters, a store, two prefill
nodes, a decode node and the router, every one of them given the three masters. Steady greedy traffic goes
through the router's HTTP API: each conversation's prompt is sent cold (nothing cached) and again at once
(round-robin: the other prefill node, which pulls the prompt from the pool). Every request must answer 200
with the token ids of a cold run of the same model in this process (no pool, no cluster: `_reference`).

- kill -9 the leader: a standby leads within the lease TTL (5 s, the default) and a margin, 0 requests fail
  and 0 answers differ, the pool's hit rate comes back to its level before the kill; the old leader,
  restarted by `kvpool up` after its back-off (longer than the failover), joins as a standby.
- kill -9 etcd (restarted by `kvpool up` after its back-off): no election is possible, the leader steps
  down and serves reads; serving never stops (0 failed, 0 wrong), and a leader leads again afterwards.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.client import MasterClient
from kvpool.errors import KVPoolError
from kvpool.rpc.security import security
from tests.capabilities import require_etcd, require_ucx
from tests.test_up_supervised import _Up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # (+ a cold reference of every answer)

MODEL = "kvpool-tiny-llama-l4-h256-a8-kv4-i688"
TTL_S = 5.0  # the masters' default lease TTL
BACKOFF_S = 10.0  # a killed role restarts after this: the failover comes first
SPEC = f"""
[cluster]
block_size = 16
masters = 3
restart_backoff_s = {BACKOFF_S}
[master]
port = 0
[store]
count = 1
segment_size = "64MiB"
[prefill]
count = 2
[router]
port = 0
policy = "round-robin"
"""


@dataclass(frozen=True, slots=True)
class Answer:
    at_s: float  # monotonic, when the request was sent
    status: int  # 0: no HTTP answer at all
    text: str
    prompt_tokens: int
    cached_tokens: int
    prompt: str = ""
    token_ids: tuple[int, ...] = ()  # the generated token ids (`return_token_ids`)


def _hit_rate(answers: list[Answer]) -> float:
    prompt = sum(a.prompt_tokens for a in answers)
    return sum(a.cached_tokens for a in answers) / prompt if prompt else 0.0


class Traffic:
    """Conversations sent in turn from a thread until `stop()`: each prompt cold, then again at once."""

    def __init__(self, url: str, tag: str) -> None:
        self.url, self.tag = url, tag
        self.cold: list[Answer] = []
        self.again: list[Answer] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"traffic-{tag}", daemon=True)
        self._thread.start()

    def _ask(self, http: httpx.Client, prompt: str) -> Answer:
        t = time.monotonic()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        try:
            r = http.post(f"{self.url}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            return Answer(t, 0, f"{type(exc).__name__}: {exc}", 0, 0)
        if r.status_code != 200:
            return Answer(t, r.status_code, r.text, 0, 0)
        js: dict[str, Any] = r.json()
        usage = js["usage"]
        return Answer(t, 200, js["choices"][0]["text"], usage["prompt_tokens"],
                      usage["prompt_tokens_details"]["cached_tokens"], prompt,
                      tuple(js["choices"][0]["token_ids"]))  # fmt: skip

    def _run(self) -> None:
        with httpx.Client(timeout=60.0) as http:
            while not self._stop.is_set():
                prompt = (
                    f"{len(self.cold):05d} {self.tag} conversation: " + "the pool keeps every prefix. " * 3
                )
                self.cold.append(self._ask(http, prompt))
                self.again.append(self._ask(http, prompt))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=90)

    def check(self) -> None:
        """0 failed requests, nothing cached on a cold run, 0 wrong answers: every answer's token ids
        (EOS left out) are those of the in-process cold reference."""
        answers = self.cold + self.again
        failed = [a for a in answers if a.status != 200]
        assert not failed, f"{len(failed)} failed: {failed[:3]}"
        assert all(a.cached_tokens == 0 for a in self.cold), [a for a in self.cold if a.cached_tokens][:3]
        refs, eos = _reference(sorted({a.prompt for a in answers}))
        wrong = [(a.prompt[:12], a.token_ids, refs[a.prompt]) for a in answers
                 if [t for t in a.token_ids if t != eos] != refs[a.prompt]]  # fmt: skip
        assert not wrong, f"{len(wrong)} wrong: {wrong[:3]}"

    def since(self, t0: float, t1: float = float("inf")) -> list[Answer]:
        return [a for a in self.again if t0 <= a.at_s < t1]


def _reference(prompts: list[str]) -> tuple[dict[str, list[int]], int | None]:
    """Each prompt's greedy answer (6 token ids, EOS left out) from the same model in this process
    (tokenized as the router does, `ModelInfo.encode`; generated by a `ModelRunner` with nothing cached),
    and the model's EOS id."""
    from kvpool.model import ModelRunner
    from kvpool.router.model_info import ModelInfo
    from kvpool.sampling import SamplingParams

    info, runner = ModelInfo.load(None, block_size=16), ModelRunner.load(None, block_size=16)
    assert runner.model_id == MODEL, runner.model_id  # the model `kvpool up` serves
    params = SamplingParams(max_tokens=6)
    return {p: runner.generate(info.encode(p), params=params) for p in prompts}, info.eos_token_id


def _pid_listening(up: _Up, port: int) -> int:
    """The pid of `kvpool up`'s child that listens on `port`."""
    import psutil

    for child in psutil.Process(up.proc.pid).children(recursive=True):
        conns = getattr(child, "net_connections", child.connections)(kind="tcp")
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns):
            return int(child.pid)
    raise AssertionError(f"no process listens on {port}:\n{up.tail()}")


def _status(address: str) -> tuple[str, str]:
    """(its role, the leader it names), ("unreachable", "") when it does not answer."""
    try:
        with MasterClient(address, timeout_s=1.0) as c:
            m = c.masters()
        return m.role, m.leader
    except KVPoolError:
        return "unreachable", ""


def _wait(predicate: Any, timeout_s: float, what: str, up: _Up) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s: {what}\n{up.tail()}"
        time.sleep(0.1)
    return time.monotonic() - t0


@dataclass
class Cluster:
    up: _Up
    url: str
    masters: list[str]  # master0, master1, master2
    etcd_port: int

    def leader(self) -> str:
        roles = {a: _status(a)[0] for a in self.masters}
        leaders = [a for a, r in roles.items() if r == "leader"]
        return leaders[0] if len(leaders) == 1 else ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_etcd()
    require_ucx()
    spec = Path(tmp_path_factory.mktemp("ha-serving")) / "cluster.toml"
    spec.write_text(SPEC)
    up = _Up(spec)
    tls = pytest.MonkeyPatch()
    try:
        up.wait_line("Ctrl-C stops everything", 240)
        for name, value in up.tls_env().items():  # the masters serve mutual TLS: this process's checks too
            tls.setenv(name, value)
        security.cache_clear()
        at = up.endpoints()
        masters = [at[f"master{i}"] for i in range(3)]
        c = Cluster(up, f"http://{at['router']}", masters, int(at["etcd"].rsplit(":", 1)[1]))
        _wait(lambda: bool(c.leader()), 20, "one leader", up)
        yield c
    finally:
        out = up.stop()
        tls.undo()
        security.cache_clear()
    assert up.proc.returncode == 0, out[-3000:]
    assert "giving up" not in out


def test_kill_the_leader_under_traffic_0_failed_0_wrong_hits_back(cluster: Cluster) -> None:
    up = cluster.up
    leader = cluster.leader()
    name = f"master{cluster.masters.index(leader)}"
    standbys = [a for a in cluster.masters if a != leader]
    traffic = Traffic(cluster.url, "leader-kill")
    try:
        time.sleep(10.0)  # steady state
        t_kill = time.monotonic()
        os.kill(_pid_listening(up, int(leader.rsplit(":", 1)[1])), signal.SIGKILL)
        failover_s = _wait(
            lambda: any(_status(a)[0] == "leader" for a in standbys), TTL_S + 4, "a standby leads", up
        )
        t_lead = time.monotonic()
        new_leader = next(a for a in standbys if _status(a)[0] == "leader")
        # kvpool up restarts the old leader after its back-off, on its port: it stands by
        up.wait_line(f"kvpool up: {name} ready in", BACKOFF_S + 30, count=2)
        _wait(lambda: _status(leader) == ("standby", new_leader), 10, "the old leader stands by", up)
        time.sleep(max(0.0, t_lead + 12.0 - time.monotonic()))  # traffic after the failover
    finally:
        traffic.stop()
    traffic.check()
    before = traffic.since(0.0, t_kill)[2:]  # (the first few warm the nodes up)
    level = _hit_rate(before)
    after = traffic.since(t_lead)
    window = 3
    back_s = next((a.at_s - t_lead for k, a in enumerate(after[: len(after) - window + 1])
                   if _hit_rate(after[k : k + window]) >= 0.9 * level), None)  # fmt: skip
    tail = traffic.since(t_lead + 5.0)
    print(
        f"\nleader kill: {len(traffic.cold) * 2} requests, 0 failed, 0 wrong; failover {failover_s:.2f} s "
        f"(TTL {TTL_S:g} s); hit rate before {level:.2f}, in the failover "
        f"{_hit_rate(traffic.since(t_kill, t_lead)):.2f}, after {_hit_rate(after):.2f} (from +5 s: "
        f"{_hit_rate(tail):.2f}); back to {0.9 * level:.2f} "
        f"{back_s if back_s is None else round(back_s, 2)} s after the new leader"
    )
    assert level > 0.5, level
    assert back_s is not None and back_s <= 5.0, back_s
    assert len(tail) >= 10 and _hit_rate(tail) >= 0.9 * level, _hit_rate(tail)
    assert _status(new_leader)[0] == "leader"


def test_etcd_killed_under_traffic_serving_never_stops(cluster: Cluster) -> None:
    up = cluster.up
    _wait(lambda: bool(cluster.leader()), 20, "one leader", up)
    traffic = Traffic(cluster.url, "etcd-kill")
    try:
        time.sleep(4.0)
        os.kill(_pid_listening(up, cluster.etcd_port), signal.SIGKILL)
        t_kill = time.monotonic()
        # no election without etcd: the leader steps down after its lease's margin and serves reads only
        _wait(
            lambda: any(_status(a)[0] == "deposed" for a in cluster.masters),
            TTL_S + 4,
            "the leader steps down",
            up,
        )
        up.wait_line("kvpool up: etcd ready in", BACKOFF_S + 30, count=2)  # kvpool up restarted it
        t_back = time.monotonic()
        _wait(lambda: bool(cluster.leader()), 3 * TTL_S, "a leader again", up)
        time.sleep(4.0)
    finally:
        traffic.stop()
    traffic.check()
    during = traffic.since(t_kill, t_back)
    print(
        f"\netcd kill: {len(traffic.cold) * 2} requests ({2 * len(during)} with etcd down for "
        f"{t_back - t_kill:.1f} s), 0 failed, 0 wrong; hit rate with etcd down {_hit_rate(during):.2f}"
    )
    assert len(during) >= 3, during
