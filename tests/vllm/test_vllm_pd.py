"""Prefill/decode with vLLM engines through the pool (issue #25), on one `kvpool up` cluster started once:
a secured master, one store, one vLLM prefill and two vLLM decode api_servers with kvpool's connector
(`--distributed-executor-backend uni`), and the router over them.

- the engines register under their roles and URLs; the router is healthy;
- P/D through the router with the openai client: completions and chat (the engine renders the chat
  template, B30) give greedy tokens equal to a single cold engine's, the decode loading the prompt from the
  pool (cached tokens > 0); so do the demo's chat turns (`kvpool demo --engine vllm`'s request path);
- a prefill whose publish fails (the only store killed -9) makes the decode recompute: same tokens;
- a decode engine killed mid-stream gives the client one clean error, and later requests succeed on the
  other decode engine;
- `kvpool up` stops everything cleanly on Ctrl-C.
The tests run in file order on the one cluster (later ones kill parts of it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 64
PROMPT = "kvpool moves the KV of a shared prefix between engines. " * 20  # ~1,100 byte tokens
ENGINE = """engine = "vllm"
python = "{python}"
kv_cache_gib = 1
engine_args = ["--max-model-len", "2048", "--enforce-eager", "--distributed-executor-backend", "uni"]
connector = {{ match_wait_s = 30.0, pd_wait_s = 5.0 }}
"""
SPEC = f"""
[cluster]
block_size = {BLOCK}
[master]
port = 0
[store]
count = 1
segment_size = "256MiB"
[prefill]
{ENGINE}
[decode]
count = 2
{ENGINE}
[router]
port = 0
"""


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Any:
    spec = tmp_path_factory.mktemp("up") / "cluster.toml"
    spec.write_text(SPEC.format(python=sys.executable))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    env["KVPOOL_FORCE_DECISION"] = "pull"  # exact hits: the tests check the pool's path, not the cost model
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec), "--quiet", "--timeout-s", "500"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    out = proc.stdout
    reader = threading.Thread(target=lambda: lines.extend(iter(out.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 600
    while not any(x.startswith("logs in") for x in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "kvpool up did not start:\n" + "".join(
            lines
        )
        time.sleep(0.5)
    text = "".join(lines)
    urls = dict(re.findall(r"(vllm-\w+)\s+(http://\S+)/v1", text))
    router = re.search(r"router\s+(http://\S+)/v1", text).group(1)  # type: ignore[union-attr]
    key_file = re.search(r"KVPOOL_SERVING_KEY_FILE=(\S+)", text).group(1)  # type: ignore[union-attr]
    engine_headers = {"Authorization": f"Bearer {Path(key_file).read_text().strip()}"}  # the engines' API key
    yield {
        "proc": proc,
        "text": text,
        "urls": urls,
        "router": router,
        "lines": lines,
        "engine_headers": engine_headers,
    }
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"} | (headers or {})
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def _model(url: str, headers: dict[str, str] | None = None) -> str:
    with urllib.request.urlopen(
        urllib.request.Request(f"{url}/v1/models", headers=headers or {}), timeout=30
    ) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


def _client(router: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=300)


def _cold(up: dict[str, Any], path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request on one decode engine alone, computed cold: a fresh cache salt (the pool and vLLM's
    own prefix cache hold nothing of that namespace)."""
    cold = body | {"cache_salt": f"cold-{uuid.uuid4().hex}"}
    return _post(f"{up['urls']['vllm-decode0']}/v1/{path}", cold, up["engine_headers"])


def test_engines_register_and_the_router_serves_them(up: dict[str, Any]) -> None:
    assert set(up["urls"]) == {"vllm-prefill0", "vllm-decode0", "vllm-decode1"}, up["text"]
    token_file = re.search(r"KVPOOL_JOIN_TOKEN_FILE=(\S+)", up["text"]).group(1)  # type: ignore[union-attr]
    master = re.search(r"^\s+master\s+(\S+)", up["text"], re.M).group(1)  # type: ignore[union-attr]
    tls = dict(re.findall(r"(KVPOOL_TLS_\w+)=(\S+)", up["text"]))  # the engines' gRPC runs mutual TLS
    assert tls, up["text"]
    nodes = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "admin", "--master", master, "nodes", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"KVPOOL_JOIN_TOKEN_FILE": token_file} | tls,
    )
    assert nodes.returncode == 0, nodes.stderr
    listed = {n["node"]["node_id"]: n for n in json.loads(nodes.stdout)}
    for name, url in up["urls"].items():
        assert listed[name]["alive"] and listed[name]["node"]["url"] == url
        assert listed[name]["node"]["role"] == name.rstrip("01")
    with urllib.request.urlopen(f"{up['router']}/health", timeout=30) as resp:
        assert json.loads(resp.read()) | {"status": "ok"} == {"status": "ok", "prefill": 1, "decode": 2}
    assert _model(up["router"]) == _model(up["urls"]["vllm-prefill0"], up["engine_headers"])
    for url in up["urls"].values():  # no door around the router: an engine takes no call without its key
        with pytest.raises(urllib.error.HTTPError) as refused:
            _model(url)
        assert refused.value.code == 401


def test_pd_through_the_router_equals_a_cold_engine(up: dict[str, Any]) -> None:
    client = _client(up["router"])
    model = _model(up["router"])
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}
    cold = _cold(up, "completions", body)
    pd = client.completions.create(**body)
    assert pd.choices[0].text == cold["choices"][0]["text"]
    assert pd.usage.prompt_tokens == cold["usage"]["prompt_tokens"]
    # the decode engine loaded the prompt the prefill engine published (all but the last partial block)
    assert (
        pd.usage.prompt_tokens_details.cached_tokens >= (pd.usage.prompt_tokens - 1) // BLOCK * BLOCK - BLOCK
    )
    # streamed, the same tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices)
    assert streamed == cold["choices"][0]["text"]
    # chat: vLLM applies its chat template on every engine, the router tokenizes with the engine (B30)
    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "and then?"}]
    chat = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0.0}
    cold_chat = _cold(up, "chat/completions", chat)
    pd_chat = client.chat.completions.create(**chat)
    assert pd_chat.choices[0].message.content == cold_chat["choices"][0]["message"]["content"]
    assert pd_chat.usage.prompt_tokens == cold_chat["usage"]["prompt_tokens"]
    assert pd_chat.usage.prompt_tokens_details.cached_tokens > 0


def test_the_demo_workload_through_pd_equals_a_cold_engine(up: dict[str, Any]) -> None:
    """`kvpool demo --engine vllm`'s request path (kvpool.demo.vllm_run) on this cluster: multi-turn chat
    turns from the trace, each turn's earlier turns loaded from the pool."""
    from kvpool.demo.vllm_run import serve_vllm_workload
    from kvpool.demo.workload import chat_requests, default_chat_trace

    turns = chat_requests(default_chat_trace(), vocab_size=256, num_conversations=1, max_prompt_tokens=1500)
    records = serve_vllm_workload(
        up["router"], up["urls"]["vllm-decode0"], turns[:3], 4, cold_headers=up["engine_headers"]
    )
    assert len(records) == 3 and all(r["greedy_equal"] for r in records), records
    assert records[-1]["cached_tokens"] > 0, records


def _children(up: dict[str, Any], needle: str) -> list[Any]:
    import psutil

    return [
        c
        for c in psutil.Process(up["proc"].pid).children(recursive=True)
        if any(needle in part for part in c.cmdline())
    ]


def test_a_failed_publish_on_prefill_makes_decode_recompute(up: dict[str, Any]) -> None:
    stores = [c for c in _children(up, "store") if "kvpool.cli.main" in c.cmdline()]
    assert len(stores) == 1
    stores[0].kill()  # the pool's only store: the prefill's publish cannot land anywhere
    stores[0].wait(10)
    client = _client(up["router"])
    body = {
        "model": _model(up["router"]),
        "prompt": "a prompt the pool never saw. " * 30,
        "max_tokens": 12,
        "temperature": 0.0,
    }
    cold = _cold(up, "completions", body)
    pd = client.completions.create(**body)
    assert pd.choices[0].text == cold["choices"][0]["text"]
    assert not pd.usage.prompt_tokens_details or pd.usage.prompt_tokens_details.cached_tokens == 0


def _running(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(m) for m in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([\d.]+)$", text, re.M))


def test_a_decode_engine_killed_mid_stream_fails_one_request_cleanly(up: dict[str, Any]) -> None:
    import openai

    client = _client(up["router"])
    body = {
        "model": _model(up["router"]),
        "prompt": "count with me: ",
        "max_tokens": 1800,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    stream = client.completions.create(**body, stream=True)
    chunks = iter(stream)
    next(chunks)  # the decode engine is streaming
    serving = [name for name in ("vllm-decode0", "vllm-decode1") if _running(up["urls"][name]) > 0]
    assert len(serving) == 1, serving
    port = up["urls"][serving[0]].rsplit(":", 1)[1]
    servers = [c for c in _children(up, "vllm.entrypoints.openai.api_server") if port in c.cmdline()]
    assert len(servers) == 1
    for victim in [*servers[0].children(recursive=True), servers[0]]:  # its engine core process too
        victim.kill()
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for _ in chunks:
            pass
    survivor = ({"vllm-decode0", "vllm-decode1"} - set(serving)).pop()
    for _ in range(3):  # later requests succeed, on the other decode engine
        out = client.completions.create(model=body["model"], prompt=PROMPT, max_tokens=4, temperature=0.0)
        assert out.choices[0].text
    assert _running(up["urls"][survivor]) == 0


def test_kvpool_up_stops_cleanly(up: dict[str, Any]) -> None:
    proc = up["proc"]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, "".join(up["lines"][-40:])
    for url in up["urls"].values():
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{url}/health", timeout=2)
