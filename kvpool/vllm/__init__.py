"""kvpool as the KV pool of vLLM engines: `KVPoolConnector`, a vLLM V1 KV connector.

The only package of kvpool that imports vllm (and only `kvpool.vllm.connector`, `.build` and `.engine_job`
do; the halves, the layout conversion and the publisher import no vllm and are tested without it). Load
the connector with `--kv-transfer-config '{"kv_connector": "KVPoolConnector",
"kv_connector_module_path": "kvpool.vllm", ...}'` (see `kvpool.vllm.connector`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVPoolConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVPoolConnector":  # imported on use: vllm is heavy and absent from kvpool's own venv
        from kvpool.vllm.connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(f"module 'kvpool.vllm' has no attribute {name!r}")
