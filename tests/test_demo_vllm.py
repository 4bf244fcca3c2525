"""`kvpool demo --engine vllm` without vLLM: the cluster spec it writes, its CLI checks and its figures.

The real run (two vLLM engines through the router) is `serve_vllm_workload` on the cluster of
tests/vllm/test_vllm_pd.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvpool.cli.main import app
from kvpool.cluster.launch import plan
from kvpool.cluster.spec import load_spec
from kvpool.demo.vllm_run import MAX_MODEL_LEN, demo_spec, summarize_by_scenario, summarize_records
from kvpool.demo.workload import chat_requests, default_chat_trace, rag_requests
from kvpool.router.model_info import ModelInfo

LAYOUT = "kv1:float32:b64:l4:h4:d32"


def test_the_demo_spec_is_a_valid_cluster_of_two_vllm_engines_and_the_router(tmp_path: Path) -> None:
    spec_path = tmp_path / "cluster.toml"
    spec_path.write_text(demo_spec("/opt/vllm env/bin/python"))
    spec = load_spec(spec_path)
    assert spec.prefill.engine == spec.decode.engine == "vllm"
    assert spec.prefill.count == spec.decode.count == spec.store.count == 1
    assert spec.master.port == 0 and spec.router.enabled and spec.router.port == 0
    launches = {launch.name: launch for launch in plan(spec, LAYOUT)}
    assert list(launches) == ["master", "store0", "vllm-prefill0", "vllm-decode0", "router"]
    decode = launches["vllm-decode0"]
    assert decode.argv[0] == "/opt/vllm env/bin/python"
    assert decode.argv[decode.argv.index("--max-model-len") + 1] == str(MAX_MODEL_LEN)
    assert "--enable-prompt-tokens-details" in decode.argv
    assert launches["router"].args[-2:] == ["--engines", "vllm"]


def test_the_demo_prompts_fit_the_engines_context() -> None:
    info = ModelInfo.load(None, block_size=64)
    rag = rag_requests(info.encode, questions_per_doc=5)
    chat = chat_requests(default_chat_trace(), vocab_size=256, num_conversations=4)
    longest = max(len(r.token_ids) for r in rag + chat)
    assert 4096 < longest <= MAX_MODEL_LEN - 64, longest


def test_the_cli_refuses_an_unknown_engine_before_anything_starts() -> None:
    result = CliRunner().invoke(app, ["demo", "--engine", "sglang"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--engine'" in result.output and "kvpool or vllm" in result.output


def test_the_cli_refuses_a_missing_vllm_python_before_anything_starts(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["demo", "--engine", "vllm", "--python", str(tmp_path / "nope")])
    assert result.exit_code == 2, result.output
    assert "no Python with vLLM" in result.output and "starting kvpool up" not in result.output


def _record(scenario: str, cached: int, warm: float, cold: float, equal: bool = True) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "request_id": f"{scenario}-{cached}",
        "label": "",
        "prompt_tokens": 1000,
        "cached_tokens": cached,
        "ttft_warm_s": warm,
        "ttft_cold_s": cold,
        "output_tokens": 8,
        "greedy_equal": equal,
    }


def test_figures_from_records() -> None:
    records = [
        _record("rag", 960, 0.1, 1.0),
        _record("rag", 960, 0.3, 1.2),
        _record("chat", 0, 0.9, 0.8),
        _record("chat", 500, 0.2, 0.6, equal=False),
    ]
    s = summarize_records(records)
    assert s["requests"] == 4 and s["requests_with_hits"] == 3
    assert s["ttft_cold_p50_s"] == pytest.approx(0.9)  # median of all cold TTFTs
    assert s["ttft_warm_p50_s"] == pytest.approx(0.2)  # median of the warm TTFTs of requests with hits
    assert s["speedup"] == pytest.approx(4.5)
    assert s["token_hit_rate"] == pytest.approx(2420 / 4000)
    assert not s["greedy_equal"] and s["num_unequal"] == 1
    per, overall = summarize_by_scenario(records)
    assert list(per) == ["rag", "chat"] and overall == s
    assert per["rag"]["greedy_equal"] and per["rag"]["token_hit_rate"] == pytest.approx(0.96)
    assert per["chat"]["requests_with_hits"] == 1


def test_no_hits_is_no_speedup_not_a_division_by_zero() -> None:
    s = summarize_records([_record("chat", 0, 0.5, 0.5)])
    assert s["requests_with_hits"] == 0 and s["speedup"] == 0.0 and s["ttft_warm_p50_s"] == 0.0
    assert summarize_records([])["requests"] == 0
