"""`kvpool up` with vLLM roles (issue #25): a secured cluster whose prefill and decode roles are vLLM's
OpenAI servers with kvpool's connector starts (engines health-checked), registers the engines with the
master under their roles and URLs, moves a prompt's KV from the prefill engine to the decode engine
through the pool (greedy text equal), and stops cleanly on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = "kvpool moves the KV of a shared prefix between engines. " * 20  # ~1,100 byte tokens
SPEC = """
[cluster]
block_size = 64
[master]
port = 0
[store]
count = 1
segment_size = "256MiB"
[prefill]
engine = "vllm"
python = "{python}"
kv_cache_gib = 1
engine_args = ["--max-model-len", "2048", "--enforce-eager", "--enable-prompt-tokens-details"]
connector = {{ match_wait_s = 30.0 }}
[decode]
engine = "vllm"
python = "{python}"
kv_cache_gib = 1
engine_args = ["--max-model-len", "2048", "--enforce-eager", "--enable-prompt-tokens-details"]
connector = {{ match_wait_s = 30.0 }}
[router]
enabled = false
"""


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Any:
    spec = tmp_path_factory.mktemp("up") / "cluster.toml"
    spec.write_text(SPEC.format(python=sys.executable))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    env["KVPOOL_FORCE_DECISION"] = "pull"  # exact hits: the test checks the pool's path, not the cost model
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec), "--quiet", "--timeout-s", "400"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("kvpool up exited:\n" + "".join(lines))
        lines.append(line)
        if line.startswith("logs in"):
            break
    yield proc, "".join(lines)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)


def test_vllm_roles_start_register_move_kv_through_the_pool_and_stop(up: Any) -> None:
    proc, text = up
    urls = dict(re.findall(r"(vllm-\w+)\s+(http://\S+)/v1", text))
    assert set(urls) == {"vllm-prefill0", "vllm-decode0"}, text
    token_file = re.search(r"KVPOOL_JOIN_TOKEN_FILE=(\S+)", text).group(1)  # type: ignore[union-attr]
    master = re.search(r"master\s+(\S+)", text).group(1)  # type: ignore[union-attr]
    model = _post_models(urls["vllm-prefill0"])
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    cold = _post(f"{urls['vllm-prefill0']}/v1/completions", body)  # computes and publishes the prompt
    time.sleep(2.0)  # the publish runs after the response
    warm = _post(f"{urls['vllm-decode0']}/v1/completions", body)  # loads the prompt's KV from the pool
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (warm["usage"]["prompt_tokens"] - 1) // 64 * 64 - 64, warm["usage"]
    nodes = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "admin", "--master", master, "nodes", "--json"],
        capture_output=True, text=True, timeout=60, env=os.environ | {"KVPOOL_JOIN_TOKEN_FILE": token_file},
    )  # fmt: skip
    assert nodes.returncode == 0, nodes.stderr
    listed = {n["node"]["node_id"]: n for n in json.loads(nodes.stdout)}
    for name, url in urls.items():
        assert listed[name]["alive"] and listed[name]["node"]["url"] == url
        assert listed[name]["node"]["role"] == name.rstrip("0")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0
    for url in urls.values():
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{url}/health", timeout=2)


def _post_models(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])
