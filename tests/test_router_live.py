"""The router against a live cluster of real processes, through the official `openai` client.

master + 1 store + 2 prefill + 1 decode + the router, all on 127.0.0.1 (the embedded byte-level model).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from kvpool.client import MasterClient  # noqa: E402
from kvpool.cluster.local import LocalCluster, LocalClusterSpec  # noqa: E402
from kvpool.cluster.process import RoleProcess  # noqa: E402
from kvpool.router.model_info import ModelInfo  # noqa: E402
from tests.tenant_files import salt_key_file, write_private  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    layout = ModelInfo.load(None, block_size=BLOCK).layout.fingerprint()
    spec = LocalClusterSpec(
        layout=layout, num_stores=1, num_prefill=2, num_decode=1, block_size=BLOCK, segment_size="64MiB",
        heartbeat_timeout_ms=30_000,
        # every hit is loaded: these tests check what the API reports for reuse, and for prompts this
        # short the cost model may (rightly) prefer recomputing over a pull on a loaded host
        extra_env={"KVPOOL_FORCE_DECISION": "pull"},
    )  # fmt: skip
    with LocalCluster(spec) as c:
        yield c


def _start_router(cluster: LocalCluster, name: str, *args: str) -> RoleProcess:
    proc = RoleProcess(
        name,
        ["router", "--master", cluster.master_address, "--port", "0", *args],
        log_path=cluster.log_dir / f"{name}.log",
    )
    cluster.processes.append(proc)  # stopped with the cluster
    proc.wait_ready(60)
    return proc


@pytest.fixture(scope="module")
def router(cluster: LocalCluster) -> str:
    proc = _start_router(cluster, "router")
    return f"http://{proc.info['http_address']}"


@pytest.fixture(scope="module")
def client(router: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return str(models[0].id)


DOC = "The pool keeps KV blocks in CPU memory on store nodes; prefill nodes publish them. " * 3


def test_completion_and_cached_tokens_on_repeat(client: openai.OpenAI, model_id: str) -> None:
    prompt = DOC + "Question one?"
    first = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0)
    assert first.object == "text_completion"
    assert first.usage is not None and first.usage.prompt_tokens == len(prompt.encode()) + 1  # + BOS
    assert first.usage.completion_tokens >= 1
    assert first.choices[0].finish_reason in ("length", "stop")
    time.sleep(0.3)  # the publish commits right after the first token; give it a moment
    second = client.completions.create(
        model=model_id, prompt=DOC + "Question two?", max_tokens=6, temperature=0
    )
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= BLOCK * 8, cached
    assert cached % BLOCK == 0
    again = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0)
    assert again.choices[0].text == first.choices[0].text  # greedy: hits do not change the output


def test_completion_streaming(client: openai.OpenAI, model_id: str) -> None:
    stream = client.completions.create(
        model=model_id, prompt=DOC + "Stream it.", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons in (["length"], ["stop"])
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens >= 1
    full = client.completions.create(model=model_id, prompt=DOC + "Stream it.", max_tokens=8, temperature=0)
    assert text == full.choices[0].text


def test_chat_streaming_and_not(client: openai.OpenAI, model_id: str) -> None:
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 6},
        {"role": "user", "content": "Say something."},
    ]
    resp = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage is not None
    time.sleep(0.3)
    messages2 = [messages[0], {"role": "user", "content": "Say something else."}]
    stream = client.chat.completions.create(
        model=model_id, messages=messages2, max_tokens=6, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= BLOCK * 8  # the shared system prompt


def test_errors_through_the_client(client: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert nf.value.status_code == 404 and "no-such-model" in str(nf.value)
    with pytest.raises(openai.BadRequestError) as big:
        client.completions.create(model=model_id, prompt="y" * 40_000, max_tokens=2)
    assert "the limit is 32767 tokens" in str(big.value)  # the model context minus one output token
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt="x", max_tokens=2, temperature=7)


def test_metrics_health_and_one_namespace(router: str, cluster: LocalCluster) -> None:
    health = httpx.get(f"{router}/health", timeout=10)
    assert health.status_code == 200 and health.json()["prefill"] == 2
    text = httpx.get(f"{router}/metrics", timeout=10).text
    assert 'kvpool_router_routing_decisions_total{node="prefill' in text
    assert "kvpool_router_ttft_seconds_bucket" in text
    cached = _metric(text, "kvpool_router_cached_tokens_total")
    prompt = _metric(text, "kvpool_router_prompt_tokens_total")
    assert 0 < cached < prompt
    assert 'kvpool_router_requests_total{code="404",endpoint="completions"} 1.0' in text
    # the router hashes in the nodes' namespace: no extra namespace was registered by its peeks
    with MasterClient(cluster.master_address) as m:
        assert m.stats().num_namespaces == 1


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in metrics")


def test_tenants_are_isolated(cluster: LocalCluster, model_id: str, tmp_path: Path) -> None:
    """A second router with a tenants file: 401 for unknown keys, tenants isolated (B09)."""
    tfile = write_private(
        tmp_path / "tenants.toml",
        '[[tenants]]\nname = "t1"\napi_keys = ["k1"]\n[[tenants]]\nname = "t2"\napi_keys = ["k2"]\n',
    )
    key = salt_key_file(tmp_path)
    proc = _start_router(cluster, "router-tenants", "--tenants", str(tfile), "--salt-key-file", str(key))
    base = f"http://{proc.info['http_address']}/v1"
    t1 = openai.OpenAI(base_url=base, api_key="k1", max_retries=0, timeout=120)
    t2 = openai.OpenAI(base_url=base, api_key="k2", max_retries=0, timeout=120)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="bad", max_retries=0).models.list()
    secret = "Tenant one's private system prompt, block after block after block. " * 2
    t1.completions.create(model=model_id, prompt=secret + "a", max_tokens=2, temperature=0)
    time.sleep(0.3)
    for forged_salt in ("", "anything"):
        r2 = t2.completions.create(
            model=model_id,
            prompt=secret + "b",
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": forged_salt},
        )
        assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
        assert r2.usage.prompt_tokens_details.cached_tokens == 0
    r1 = t1.completions.create(model=model_id, prompt=secret + "c", max_tokens=2, temperature=0)
    assert r1.usage is not None and r1.usage.prompt_tokens_details is not None
    assert (r1.usage.prompt_tokens_details.cached_tokens or 0) >= BLOCK * 4  # the paired positive
