"""The phases of `kvpool bench master --blocks N` after the fill (`master_scale`): publish rates, the
rebuild of a restarted master from its stores' inventories, and the stalls a node death and an eviction
cause, each through the master's public gRPC service only.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import urllib.request
from typing import Any

import numpy as np

from kvpool.bench.master_scale import MODEL, ScaleCluster, block_bytes
from kvpool.bench.master_scale_work import block_hash
from kvpool.client import MasterClient
from kvpool.errors import KVPoolError

PUBLISH_SALT = "publish"
_DEATHS = "kvpool_master_node_deaths_total"
"""Node removals the master finished (the lock metrics are read once it counts the victim's)."""
_LOCK_NAME = re.compile(r"(^|_)lock(_|$)|watermark_tick|node_deaths")


def publish_rates(cluster: ScaleCluster, *, clients: int, chains: int, chain_blocks: int) -> dict[str, Any]:
    """`publish_blocks_per_s`: `clients` processes each Reserve + Commit `chains` fresh chains of
    `chain_blocks` blocks through the master's gRPC service on the cluster's `--metadata-only` stores (a
    commit needs no bytes there: every block becomes resident), one replica per block, `BATCH_CHAINS`
    chains per ReserveBatch + CommitBatch; `publish_single_blocks_per_s`: the same with one Reserve + Commit
    per chain; then batched again at two replicas per block: `bytes_per_extra_replica` = (the growth of
    the index's own memory accounting, `kvpool_master_index_memory_bytes`, at two replicas − at one) /
    blocks; `bytes_per_extra_replica_rss` the same from the master's RSS (allocator steps make it noisy
    at this size). `publish_e2e_blocks_per_s`: `chains` chains through
    `PoolClient.put_blocks` (Reserve → UCX write → Commit, one client) on a separate small cluster of one
    normal store."""
    from kvpool.bench.master_publish import BATCH_CHAINS, ChainWork, publish

    (ns,) = cluster.register([PUBLISH_SALT])
    single = publish(
        cluster.address,
        [ChainWork(ns, 1 + 2 * clients + k, chains) for k in range(clients)],
        chain_blocks=chain_blocks,
    )
    time.sleep(1.0)
    rss0, acct0 = cluster.master_rss_bytes(), _index_memory_bytes(cluster)
    one = publish(
        cluster.address,
        [ChainWork(ns, 1 + k, chains) for k in range(clients)],
        chain_blocks=chain_blocks,
        batch_chains=BATCH_CHAINS,
    )
    time.sleep(1.0)
    rss1, acct1 = cluster.master_rss_bytes(), _index_memory_bytes(cluster)
    two = publish(
        cluster.address,
        [ChainWork(ns, 1 + clients + k, chains) for k in range(clients)],
        chain_blocks=chain_blocks,
        replicas=2,
        batch_chains=BATCH_CHAINS,
    )
    time.sleep(1.0)
    rss2, acct2 = cluster.master_rss_bytes(), _index_memory_bytes(cluster)
    n = clients * chains * chain_blocks
    if one.blocks != n or two.blocks != n or single.blocks != n:
        raise RuntimeError(
            f"publish committed {single.blocks}, {one.blocks} and {two.blocks} blocks, not {n} each"
        )
    return {
        "publish_blocks_per_s": one.blocks_per_s,
        "publish_calls_per_s": round(one.calls / max(one.seconds, 1e-9), 1),
        "publish_batch_chains": BATCH_CHAINS,
        "publish_single_blocks_per_s": single.blocks_per_s,
        "publish_single_calls_per_s": round(single.calls / max(single.seconds, 1e-9), 1),
        "publish_two_replicas_blocks_per_s": two.blocks_per_s,
        "bytes_per_extra_replica": round(((acct2 - acct1) - (acct1 - acct0)) / n, 1),
        "bytes_per_extra_replica_rss": round(((rss2 - rss1) - (rss1 - rss0)) / n, 1),
        "publish_e2e_blocks_per_s": publish_e2e(chains, chain_blocks),
        "publish_chain_blocks": chain_blocks,
        "publish_chains": clients * chains,
        "publish_clients": clients,
    }


def publish_e2e(chains: int, chain_blocks: int) -> float:
    """Blocks/s of `chains` fresh chains of `chain_blocks` blocks through `PoolClient.put_blocks` (bytes
    written over UCX and verified) from one client, on a master with one normal tiny-layout store."""
    from kvpool.client import PoolClient
    from transfer import UcxTransport

    with ScaleCluster(chains * chain_blocks, num_stores=1) as small:
        (ns,) = small.register([PUBLISH_SALT])
        transport = UcxTransport()
        try:
            with PoolClient(small.address, transport, block_nbytes=small.block_nbytes) as pc:
                t0 = time.perf_counter()
                for c in range(chains):
                    chain = [block_hash(ns, (2 << 40) + c * chain_blocks + b) for b in range(chain_blocks)]
                    r = pc.put_blocks(ns, None, chain, [block_bytes(h, small.block_nbytes) for h in chain])
                    if r.num_committed != chain_blocks:
                        raise RuntimeError(f"a put of {chain_blocks} blocks committed {r.num_committed}")
                wet_s = time.perf_counter() - t0
        finally:
            transport.close()
    return round(chains * chain_blocks / wet_s, 1)


def rebuild(
    cluster: ScaleCluster, salts: list[str], probe: tuple[bytes, list[bytes], int], timeout_s: float
) -> dict[str, Any]:
    """Kill -9 the master and start it again on its port with the stores alive; register the namespaces
    again at once (as engines do) and poll. `rebuild_s`: from the first store registration the restarted
    master lists to the Stats block count reaching what the killed master held; `first_hit_s`: from the
    kill until `probe` (namespace, prompt, blocks it must match) matches fully again."""
    with MasterClient(cluster.address) as c:
        target = c.stats().num_blocks
    t_kill = time.perf_counter()
    cluster.kill_master()
    cluster.start_master()
    cluster.register(salts)
    t_first = t_hit = t_done = None
    blocks = 0
    with MasterClient(cluster.address, timeout_s=30) as c:
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline and (t_done is None or t_hit is None):
            now = time.perf_counter()
            if t_first is None and any(n.node.role == "store" for n in c.list_nodes()):
                t_first = now
            if t_hit is None and c.match(probe[0], probe[1]).num_matched >= probe[2]:
                t_hit = now
            if t_done is None:
                blocks = c.stats().num_blocks
                if blocks >= target:
                    t_done = time.perf_counter()
            time.sleep(0.02)
    rss = cluster.master_rss_bytes()
    out: dict[str, Any] = {"rebuild_target_blocks": target, "rebuild_blocks_reached": blocks}
    if t_first is not None and t_done is not None:
        out["rebuild_s"] = round(t_done - t_first, 2)
        out["rebuild_blocks_per_s"] = round(target / max(t_done - t_first, 1e-6), 1)
    else:
        out["rebuild_s"] = None
        out["rebuild_blocks_per_s"] = None
    out["restart_to_first_store_s"] = None if t_first is None else round(t_first - t_kill, 2)
    out["first_hit_s"] = None if t_hit is None else round(t_hit - t_kill, 2)
    out["rss_after_rebuild_bytes"] = rss
    return out


class _Probe:
    """A thread matching one prompt back to back (no lease, not counted); records (start, latency s)."""

    def __init__(self, address: str, ns: bytes, prompt: list[bytes]) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(
            target=self._run, args=(address, ns, prompt), name="bench-probe", daemon=True
        )
        self._t.start()

    def _run(self, address: str, ns: bytes, prompt: list[bytes]) -> None:
        with MasterClient(address, timeout_s=60) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                with contextlib.suppress(KVPoolError):  # a failed match is timed like any other
                    c.match(ns, prompt)
                self.samples.append((t0, time.perf_counter() - t0))
                time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()

    def worst_ms(self, since: float, until: float) -> float:
        """The longest match latency started in [since, until], ms (a call that straddled a lock-held
        stretch waited for it)."""
        lat = [d for t, d in self.samples if since <= t <= until]
        return round(max(lat) * 1e3, 1) if lat else float("nan")

    def median_ms(self) -> float:
        return (
            round(float(np.median([d for _, d in self.samples])) * 1e3, 2) if self.samples else float("nan")
        )


def _index_memory_bytes(cluster: ScaleCluster) -> float:
    """The master's `kvpool_master_index_memory_bytes` (the index's own accounting), 0 without metrics."""
    return _metrics(cluster, re.compile(r"^kvpool_master_index_memory_bytes$")).get(
        "kvpool_master_index_memory_bytes", 0.0
    )


def _metrics(cluster: ScaleCluster, pattern: re.Pattern[str]) -> dict[str, float]:
    """Every sample of the master's /metrics whose name `pattern` finds (empty without metrics)."""
    assert cluster.master is not None
    addr = cluster.master.ready.get("metrics_address")
    if not addr:
        return {}
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:  # noqa: S310 - our own master
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not pattern.search(line.split("{")[0].split(" ")[0]):
            continue
        name, _, value = line.rpartition(" ")
        out[name] = float(value)
    return out


def lock_metrics(cluster: ScaleCluster) -> dict[str, float]:
    """The master's lock-held samples (node death, maintenance tick, adoption holds) and node deaths."""
    return _metrics(cluster, _LOCK_NAME)


def lock_held(
    cluster: ScaleCluster, probe: tuple[bytes, list[bytes], int], *, evict_blocks: int
) -> dict[str, Any]:
    """Stalls a concurrent match sees (the master answers matches under the same lock):
    `evict_stall_ms` while the admin Evict RPC evicts `evict_blocks` blocks of store 0 (what a watermark
    tick does under the lock, called on demand), `node_death_stall_ms` from a kill -9 of the last store
    until the master has finished removing it (its node-death count rises) and 1 s more. Plus the master's own lock metrics."""
    out: dict[str, Any] = {"lock_metrics_before": lock_metrics(cluster)}
    p = _Probe(cluster.address, probe[0], probe[1])
    try:
        time.sleep(2.0)
        out["probe_match_median_ms"] = p.median_ms()
        with MasterClient(cluster.address, timeout_s=120) as c:
            s0 = next(n for n in c.list_nodes() if n.node.node_id == "scale-s0")
            t0 = time.perf_counter()
            evicted, _ = c.evict(min(1.0, evict_blocks / max(1, s0.num_blocks)), "scale-s0")
            t1 = time.perf_counter()
            out["evict_blocks"] = evicted
            out["evict_call_ms"] = round((t1 - t0) * 1e3, 1)
            time.sleep(1.0)
            out["evict_stall_ms"] = p.worst_ms(t0, t1)
            victim = cluster.stores[-1]
            vid = f"scale-s{len(cluster.stores) - 1}"
            before = next(n for n in c.list_nodes() if n.node.node_id == vid).num_blocks
            t0 = time.perf_counter()
            victim.kill()
            while any(n.alive for n in c.list_nodes() if n.node.node_id == vid):
                time.sleep(0.05)
            t1 = time.perf_counter()
            deaths = lock_metrics(cluster).get(_DEATHS, 0.0)
            deadline = t1 + 120.0  # its rows leave in steps from the next maintenance tick on
            while time.perf_counter() < deadline and lock_metrics(cluster).get(_DEATHS, 0.0) <= deaths:
                time.sleep(0.1)
            time.sleep(1.0)
            out["node_death_removed_s"] = round(time.perf_counter() - 1.0 - t1, 2)
            out["node_death_blocks"] = before
            out["node_death_detect_s"] = round(t1 - t0, 2)
            out["node_death_stall_ms"] = p.worst_ms(t0, time.perf_counter())
    finally:
        p.stop()
    out["lock_metrics_after"] = lock_metrics(cluster)
    return out


__all__ = ["MODEL", "lock_held", "publish_rates", "rebuild"]
