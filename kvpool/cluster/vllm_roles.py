"""vLLM roles of a cluster spec: vLLM's OpenAI server with kvpool's connector, as `kvpool up` starts it."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from kvpool.cluster.launch import Launch
from kvpool.cluster.spec import ServingSection


def vllm_launch(
    role: str, i: int, host: str, section: ServingSection, *, block_size: int, layout: str
) -> Launch:
    """vLLM's OpenAI server for role `role` (prefill or decode) instance `i`, its connector registered with
    the master as `vllm-<role>` at its URL. The dtype is the pool layout's; a free port is picked here for
    a local engine without a fixed one."""
    from kvpool.types import KVLayout

    if section.port:
        port = section.port + i
    else:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
    url = f"http://{host}:{port}"
    name = f"vllm-{role}{i}"
    kv = {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            **section.connector,
            "master": "{master}",
            "role": role,
            "url": url,
            "node_id": name,
        },
    }
    python = section.python or vllm_python()
    dtype = KVLayout.from_fingerprint(layout).dtype
    args = section.engine_args
    details = [] if "--enable-prompt-tokens-details" in args else ["--enable-prompt-tokens-details"]
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--host", host,
        "--port", str(port), "--dtype", dtype, "--block-size", str(block_size),
        "--kv-transfer-config", json.dumps(kv), *details, *args,
    ]  # fmt: skip
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": f"{section.kv_cache_gib:g}"}
    return Launch(name, f"vllm-{role}", host, argv=argv, env=env, ready_url=f"{url}/health")


def vllm_python() -> str:
    """`.venv-vllm/bin/python` (what `make test-vllm` builds) in this directory or kvpool's checkout, else
    `python`; set `[prefill|decode] python` for another environment."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = root / ".venv-vllm" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return "python"
