"""A cluster spec's vLLM roles (issue #25): `engine = "vllm"` plans vLLM's OpenAI server with kvpool's
connector (its role, URL and node id in the extra config, the pool's dtype and block size), health-checked
on its URL; specs the launcher cannot honour are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cluster.launch import plan
from kvpool.cluster.spec import load_spec
from kvpool.errors import InvalidArgument

LAYOUT = "kv1:bfloat16:b64:l4:h4:d32"
VLLM = """
[master]
port = 0
[prefill]
engine = "vllm"
python = "/opt/vllm/bin/python"
engine_args = ["--enforce-eager"]
kv_cache_gib = 2
connector = { match_wait_s = 5.0 }
[decode]
engine = "vllm"
count = 2
port = 8200
[router]
enabled = false
"""


def _load(tmp_path: Path, text: str) -> object:
    p = tmp_path / "cluster.toml"
    p.write_text(text)
    return load_spec(p)


def test_vllm_roles_plan_api_servers_with_the_connector(tmp_path: Path) -> None:
    launches = {x.name: x for x in plan(_load(tmp_path, VLLM), LAYOUT)}  # type: ignore[arg-type]
    assert set(launches) == {"master", "store0", "store1", "vllm-prefill0", "vllm-decode0", "vllm-decode1"}
    p = launches["vllm-prefill0"]
    assert p.role == "vllm-prefill" and not p.args and p.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    argv = p.resolved("10.0.0.1:50051", "/models/m")
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "/models/m" and argv[-1] == "--enforce-eager"
    assert "--enable-prompt-tokens-details" in argv  # responses show the cached tokens
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--block-size") + 1] == "64"
    port = int(argv[argv.index("--port") + 1])
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "KVPoolConnector" and kv["kv_connector_module_path"] == "kvpool.vllm"
    extra = kv["kv_connector_extra_config"]
    assert extra == {"master": "10.0.0.1:50051", "role": "prefill", "url": f"http://127.0.0.1:{port}",
                     "node_id": "vllm-prefill0", "match_wait_s": 5.0}  # fmt: skip
    assert p.ready_url == f"http://127.0.0.1:{port}/health"
    decode_argv = [launches[f"vllm-decode{i}"].argv for i in range(2)]
    decode_ports = [json.loads(a[a.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["url"]
                    for a in decode_argv]  # fmt: skip
    assert decode_ports == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    assert "kvpool " not in launches["vllm-decode1"].command("m:1")


def test_a_router_over_vllm_engines_is_planned_after_them_without_a_model(tmp_path: Path) -> None:
    launches = plan(_load(tmp_path, VLLM.replace("enabled = false", "enabled = true")), LAYOUT)  # type: ignore[arg-type]
    assert [x.name for x in launches][-1] == "router"
    args = launches[-1].args
    assert args[args.index("--engines") + 1] == "vllm"
    assert (
        "--model" not in args and "--block-size" not in args
    )  # the engines tokenize and name their namespace


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM.replace("enabled = false", "enabled = true").replace('count = 2\n', 'count = 2\nengine = "kvpool"\n', 1)
         .replace('[decode]\nengine = "vllm"\n', "[decode]\n"), "set prefill.engine and decode.engine alike"),
        (VLLM.replace('engine = "vllm"\npython', 'engine = "vllm"\nhosts = ["10.0.0.9"]\npython'),
         "needs a fixed port"),
        (VLLM.replace('engine = "vllm"\npython', 'engine = "sglang"\npython'), "prefill.engine"),
        (VLLM.replace("kv_cache_gib = 2", "kv_cache_gib = 0"), "prefill.kv_cache_gib"),
        (VLLM.replace("match_wait_s = 5.0", "url = 'x'"), "url: set by kvpool up"),
        (VLLM.replace("match_wait_s = 5.0", "match_wait = 5"), "unknown connector keys: match_wait"),
    ],
)  # fmt: skip
def test_a_spec_the_launcher_cannot_honour_is_refused(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(InvalidArgument, match=expected):
        _load(tmp_path, text)


def test_the_vllm_example_spec_plans_pd_through_the_pool() -> None:
    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "cluster-vllm.toml")
    names = [x.name for x in plan(spec, "kv1:float32:b64:l4:h4:d32")]
    assert names == ["master", "store0", "vllm-prefill0", "vllm-decode0", "vllm-decode1", "router"]
