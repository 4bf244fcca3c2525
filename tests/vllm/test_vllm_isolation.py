"""Nothing is shared across what makes KV different: tenants (`cache_salt`), adapters (LoRA: the digest of
the adapter's files), models (weights digest) and engines (the engine identity in the namespace).

Engine A publishes one prompt under tenant t1, the base model and adapter 1; a fresh engine B asks for it
under each identity (0 hits where it differs, the full prefix where it is the same: the control); an engine
on another model asks for it too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.hashing import Namespace
from kvpool.types import KVLayout
from kvpool.vllm.identity import Namespaces, directory_digest, model_identity
from tests.vllm.harness import BLOCK, FP32_LAYOUT, model_dir, run_engine, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPT = tokens(900, 800)
FULL = (len(PROMPT) - 1) // BLOCK * BLOCK


def make_adapter(path: Path, seed: int, rank: int = 8) -> str:
    """A LoRA adapter for the embedded model's q_proj/v_proj, in PEFT's file format (random B: it changes
    the outputs)."""
    from safetensors.numpy import save_file

    cfg = json.loads((Path(model_dir()) / "config.json").read_text())
    hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for name, out in (("q_proj", heads * head_dim), ("v_proj", kv_heads * head_dim)):
            key = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((rank, hidden), dtype=np.float32) * 0.1
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((out, rank), dtype=np.float32) * 0.1
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "fan_in_fan_out": False,
        "base_model_name_or_path": model_dir(),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def req(**extra: Any) -> dict[str, Any]:
    return {"prompt_token_ids": PROMPT, "max_tokens": 8, **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("adapters")
    a1 = {"lora_name": "a1", "lora_id": 1, "lora_path": make_adapter(root / "a1", seed=1)}
    a2 = {"lora_name": "a2", "lora_id": 2, "lora_path": make_adapter(root / "a2", seed=2)}
    spec = LocalClusterSpec(layout=FP32_LAYOUT, num_stores=1, num_prefill=0, num_decode=0)
    with LocalCluster(spec) as cluster:
        m = cluster.master_address
        lora = {"enable_lora": True, "max_lora_rank": 8}
        a = run_engine(
            {"master": m, **lora, "phases": [[req(cache_salt="t1"), req(), req(**a1)]], "settle_s": 1.0}
        )
        b = run_engine(
            {
                "master": m,
                **lora,
                "phases": [[req(cache_salt="t2"), req(cache_salt="t1"), req(**a2), req(**a1), req()]],
            },
            exact_hits=True,
        )
        other = run_engine({"master": m, "model": model_dir(seed=1), "phases": [[req()]]}, exact_hits=True)
    return {"a": a["phases"][0], "b": b["phases"][0], "other_model": other["phases"][0]}


def test_tenants_share_nothing(runs: dict[str, Any]) -> None:
    t2, t1 = runs["b"][0], runs["b"][1]
    assert t2["num_cached_tokens"] == 0
    assert t1["num_cached_tokens"] == FULL  # control: the same tenant hits
    assert t1["tokens"] == runs["a"][0]["tokens"] == t2["tokens"]  # salts change no output


def test_adapters_share_nothing_and_are_keyed_by_content(runs: dict[str, Any]) -> None:
    a2, a1 = runs["b"][2], runs["b"][3]
    assert a2["num_cached_tokens"] == 0
    assert a1["num_cached_tokens"] == FULL
    assert a1["tokens"] == runs["a"][2]["tokens"]
    assert a1["tokens"] != runs["a"][1]["tokens"]  # the adapter really changes the model's output


def test_the_base_model_hits_its_own_prefix_only(runs: dict[str, Any]) -> None:
    base = runs["b"][4]
    assert base["num_cached_tokens"] == FULL
    assert base["tokens"] == runs["a"][1]["tokens"]


def test_another_model_shares_nothing(runs: dict[str, Any]) -> None:
    assert runs["other_model"][0]["num_cached_tokens"] == 0


def test_engine_identity_and_adapter_content_are_in_the_namespace(tmp_path: Path) -> None:
    layout = KVLayout.from_fingerprint(FP32_LAYOUT)
    model_id, weights = model_identity(Path(model_dir()))
    mk = lambda engine: Namespaces(model_id=model_id, weights_version=weights, layout=layout, engine=engine)  # noqa: E731
    vec = mk("vllm-0.32.0-cpu-vec").namespace(cache_salt=None, lora_path=None)
    amx = mk("vllm-0.32.0-cpu-amx").namespace(cache_salt=None, lora_path=None)
    own = Namespace(model_id=model_id, weights_version=weights, layout=layout)  # kvpool's own runner
    assert len({vec.digest(), amx.digest(), own.digest()}) == 3
    path = make_adapter(tmp_path / "a", seed=3)
    before = mk("e").namespace(cache_salt=None, lora_path=path)
    (Path(path) / "adapter_config.json").write_text('{"r": 8, "changed": true}')
    after = mk("e").namespace(cache_salt=None, lora_path=path)  # same path and name, new content
    assert before.adapter_digest != after.adapter_digest == directory_digest(Path(path))
