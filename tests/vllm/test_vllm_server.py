"""vLLM's OpenAI server (its default multi-process engine) on a bf16 pool: the server computes and publishes
a text prompt; a fresh in-process engine loads it from the pool and gives the same greedy text.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvpool.client import MasterClient
from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.model.export import export_model_dir
from kvpool.model.tokenizer import ByteTokenizer
from tests.vllm.harness import BF16_LAYOUT, BLOCK, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

TEXT = "".join(random.Random(5).choice("abcdefghij klmnopqrstuvwxyz,.") for _ in range(1300))
TOKENIZER = ByteTokenizer(bos_token_id=256, eos_token_id=257, vocab_size=259)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()[-5000:]}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise AssertionError(f"server not ready in {timeout_s}s:\n{log.read_text()[-5000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = export_model_dir(tmp_path_factory.mktemp("model") / "kvpool-tiny")
    log = tmp_path_factory.mktemp("logs") / "server.log"
    spec = LocalClusterSpec(layout=BF16_LAYOUT, num_stores=1, num_prefill=0, num_decode=0)
    with LocalCluster(spec) as cluster:
        port = _free_port()
        kv = {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "master": cluster.master_address,
                "role": "prefill",
                "url": f"http://127.0.0.1:{port}",
            },
        }
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--dtype",
            "bfloat16",
            "--block-size",
            "64",
            "--max-model-len",
            "4096",
            "--enforce-eager",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-transfer-config",
            json.dumps(kv),
        ]
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(base, proc, log)
            body = {"model": str(model), "prompt": TEXT, "max_tokens": 12, "temperature": 0.0}
            served = _post(f"{base}/v1/completions", body)
            chat = _post(
                f"{base}/v1/chat/completions",
                {"model": str(model), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
            time.sleep(1.0)  # the publish runs after the response (and a heartbeat or two)
            with MasterClient(cluster.master_address) as mc:
                engines = [n for n in mc.list_nodes() if n.node.role.startswith("vllm")]
            serving_log = log.read_text()  # vLLM's own SIGTERM shutdown kills its engine at once: noise
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        # vLLM's SIGTERM ends its engine process before the connector's shutdown can deregister it: the
        # master drops the engine at its heartbeat timeout (10 s here)
        deadline = time.monotonic() + 30
        while True:
            with MasterClient(cluster.master_address) as mc:
                after = {n.node.node_id: n.alive for n in mc.list_nodes()}
            if not any(after.values()) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        ids = TOKENIZER.encode(TEXT)
        job = {
            "master": cluster.master_address,
            "model": str(model),
            "dtype": "bfloat16",
            "phases": [[{"prompt_token_ids": ids, "max_tokens": 12}]],
        }
        fresh = run_engine(job, exact_hits=True)["phases"][0][0]
    return {"served": served, "chat": chat, "fresh": fresh, "ids": ids, "log": serving_log, "engines": engines,
            "after": after, "url": base}  # fmt: skip


def test_the_server_publishes_and_a_fresh_engine_loads_the_same_text(runs: dict[str, Any]) -> None:
    served_text = runs["served"]["choices"][0]["text"]
    assert runs["served"]["usage"]["prompt_tokens"] == len(runs["ids"])
    assert runs["fresh"]["num_cached_tokens"] == (len(runs["ids"]) - 1) // BLOCK * BLOCK, runs["fresh"][
        "kvpool"
    ]
    assert TOKENIZER.decode(runs["fresh"]["tokens"]) == served_text


def test_chat_completions_work_through_the_connector(runs: dict[str, Any]) -> None:
    assert runs["chat"]["choices"][0]["message"]["content"] is not None
    assert "Traceback" not in runs["log"]  # while serving
    assert "[kvpool.vllm.scheduler] [" in runs["log"]  # the connector's decisions are in the server's log


def test_the_engine_is_a_cluster_member_with_its_role_url_and_load(runs: dict[str, Any]) -> None:
    """`kvpool admin nodes` lists a vLLM engine while it serves, and drops it when it stops (issue #25)."""
    [engine] = runs["engines"]
    assert engine.alive and engine.node.role == "vllm-prefill" and engine.node.url == runs["url"]
    assert 0.0 <= engine.load.kv_usage <= 1.0 and engine.load.queue_len == 0  # idle after its requests
    assert runs["after"][engine.node.node_id] is False  # gone once it stopped
