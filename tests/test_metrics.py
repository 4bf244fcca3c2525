"""Prometheus `/metrics` on every role (issue #11): real servers on 127.0.0.1, ephemeral ports.

In-process: two masters in one process keep separate registries; `--no-metrics` announces no address.
Live: master + 1 store + 1 prefill + 1 decode + the router as real processes; after two requests through
the router every role's `/metrics` parses and its counters match what was sent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.client import MasterClient
from kvpool.cluster.launch import plan
from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.cluster.process import RoleProcess
from kvpool.cluster.spec import ClusterSpec
from kvpool.master import MasterSettings, serve

BLOCK = 16
LAYOUT = "kv1:float32:b16:l4:h2:d32"


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """`/metrics` at `address` as {(sample name, sorted labels): value}; fails unless it parses."""
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} not in {sorted(k for k in samples if k[0].startswith(name[:20]))}"
    return float(samples[key])


def total(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    """Sum of `name` over every label set that includes `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_masters_in_one_process_have_their_own_registries() -> None:
    a = serve(MasterSettings(port=0, layout=LAYOUT))
    b = serve(MasterSettings(port=0, layout=LAYOUT))
    off = serve(MasterSettings(port=0, layout=LAYOUT, metrics=False))
    try:
        assert a.metrics_address != b.metrics_address
        assert off.metrics_address == "" and off.metrics is None
        from kvpool.client import MasterClient

        with MasterClient(a.address) as m:
            m.stats()
        sa, sb = scrape(a.metrics_address), scrape(b.metrics_address)
        for s in (sa, sb):
            assert value(s, "kvpool_master_match_requests_total") == 0
            assert value(s, "kvpool_master_nodes_alive", role="store") == 0
            assert value(s, "kvpool_master_index_blocks") == 0
    finally:
        for server in (a, b, off):
            server.stop()


def test_spec_passes_fixed_metrics_ports() -> None:
    spec = ClusterSpec.model_validate({"master": {"metrics_port": 9100}, "store": {"metrics_port": 9110}})
    launches = {x.name: x for x in plan(spec, LAYOUT)}
    assert "--metrics-port 9100" in launches["master"].command("m:1")
    assert "--metrics-port 9111" in launches["store1"].command("m:1")
    assert "--metrics-port" not in launches["prefill0"].command("m:1")


# ---------------------------------------------------------------- a live cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    pytest.importorskip("torch")
    from kvpool.router.model_info import ModelInfo

    layout = ModelInfo.load(None, block_size=BLOCK).layout.fingerprint()
    spec = LocalClusterSpec(
        layout=layout, num_stores=1, block_size=BLOCK, segment_size="32MiB", heartbeat_timeout_ms=30_000,
        # every reuse is a pull over UCX, forced: for these short prompts the cost model may (rightly)
        # prefer recomputing on a loaded host, and this test checks the counters of a pull
        extra_env={"KVPOOL_LOCAL_TIER_BYTES": "0", "KVPOOL_FORCE_DECISION": "pull"},
    )  # fmt: skip
    with LocalCluster(spec) as c:
        router = RoleProcess(
            "router",
            ["router", "--master", c.master_address, "--port", "0"],
            log_path=c.log_dir / "router.log",
        )
        c.processes.append(router)  # stopped with the cluster
        router.wait_ready(60)
        yield c


def _complete(router: str, prompt: str) -> dict:  # type: ignore[type-arg]
    model = httpx.get(f"http://{router}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"http://{router}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage: dict = r.json()["usage"]  # type: ignore[type-arg]
    return usage


def test_every_role_serves_metrics_that_count_the_requests(cluster: LocalCluster) -> None:
    router = next(p for p in cluster.processes if p.name == "router").info["http_address"]
    doc = "Blocks of KV live in CPU memory on the store nodes of the pool. " * 3
    first = _complete(router, doc + "One?")
    time.sleep(0.5)  # the publish commits right after the first token
    second = _complete(router, doc + "Two?")
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    prompt_tokens = first["prompt_tokens"] + second["prompt_tokens"]
    addrs = cluster.metrics_addresses
    assert set(addrs) == {"master", "store0", "prefill0", "decode0"}
    store_data = cluster.stores[0].info["data_address"]

    deadline = time.monotonic() + 10  # decode publishes prompt + output after the stream ends
    while True:
        pre, dec = scrape(addrs["prefill0"]), scrape(addrs["decode0"])
        if value(dec, "kvpool_decode_requests_total") == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # prefill: the prompts as sent, the second one's reuse pulled from the store node
    assert value(pre, "kvpool_prefill_requests_total") == 2
    assert value(pre, "kvpool_prefill_prompt_tokens_total") == prompt_tokens
    assert value(pre, "kvpool_prefill_reused_tokens_total", source="pulled") == cached
    assert value(pre, "kvpool_prefill_reused_tokens_total", source="local") == 0
    assert value(pre, "kvpool_prefill_decisions_total", decision="pull") == 1
    assert value(pre, "kvpool_prefill_pulled_bytes_total") > 0
    assert value(pre, "kvpool_prefill_link_bytes_total", peer=store_data, op="read") == value(
        pre, "kvpool_prefill_pulled_bytes_total"
    )
    assert value(pre, "kvpool_prefill_link_bytes_total", peer=store_data, op="write") > 0  # its publishes
    assert value(pre, "kvpool_prefill_link_seconds_count", peer=store_data, op="read") >= 1
    assert value(pre, "kvpool_prefill_ttft_seconds_count") == 2
    assert value(pre, "kvpool_prefill_pull_seconds_count") == 1
    assert value(pre, "kvpool_prefill_queue_length") == 0
    # decode: both prompts, their committed blocks pulled, one TPOT sample per request
    assert value(dec, "kvpool_decode_prompt_tokens_total") == prompt_tokens
    assert value(dec, "kvpool_decode_reused_tokens_total", source="pulled") > 0
    assert value(dec, "kvpool_decode_tpot_seconds_count") == 2
    assert total(dec, "kvpool_decode_link_bytes_total", op="read") > 0
    # master: the prefill's counted matches (the denominator explicit), pool usage per store node; every
    # lease released once the pulls ended (the releases go out in the background)
    with MasterClient(cluster.master_address) as mc:
        deadline = time.monotonic() + 10
        while mc.stats().num_live_leases and time.monotonic() < deadline:
            time.sleep(0.1)
    mas = scrape(addrs["master"])
    assert value(mas, "kvpool_master_match_requests_total") == 2
    assert value(mas, "kvpool_master_requested_tokens_total") == prompt_tokens
    assert value(mas, "kvpool_master_hit_tokens_total") >= cached
    assert value(mas, "kvpool_master_index_blocks") > 0
    assert value(mas, "kvpool_master_store_used_slots", node="store0") > 0
    assert value(mas, "kvpool_master_store_capacity_slots", node="store0") > 0
    assert value(mas, "kvpool_master_nodes_alive", role="prefill") == 1
    assert value(mas, "kvpool_master_live_leases") == 0
    # store: the blocks it took in and served
    sto = scrape(addrs["store0"])
    assert value(sto, "kvpool_store_used_slots") > 0
    assert value(sto, "kvpool_store_used_slots") + value(sto, "kvpool_store_free_slots") == value(
        sto, "kvpool_store_slots"
    )
    assert value(sto, "kvpool_store_blocks_served_total", op="write") > 0
    # reads: at most what prefill and decode nodes pulled (same-host readers that copy from the mapped
    # segment without asking are not seen by the store: transfer/slot_state.py; tests/test_store_slots.py
    # counts the reads it grants)
    pulled = total(pre, "kvpool_prefill_link_bytes_total", op="read") + total(
        dec, "kvpool_decode_link_bytes_total", op="read"
    )
    assert 0 <= value(sto, "kvpool_store_served_bytes_total", op="read") <= pulled
    assert value(sto, "kvpool_store_inflight_transfers") == 0
