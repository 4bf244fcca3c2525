"""Cluster spec validation (file, line, field in every error) and `kvpool up` (slow: a real cluster)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvpool.cluster.launch import plan
from kvpool.cluster.spec import load_spec, parse_size
from kvpool.errors import InvalidArgument

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"


def _spec(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cluster.toml"
    p.write_text(text)
    return p


def test_example_spec_loads_and_plans() -> None:
    spec = load_spec(EXAMPLE)
    launches = plan(spec, "kv1:float32:b64:l4:h4:d32")
    assert [x.name for x in launches] == [
        "master",
        "store0",
        "store1",
        "prefill0",
        "prefill1",
        "decode0",
        "router",
    ]
    assert all(x.local for x in launches)
    assert "--segment-size 256MiB" in launches[1].command("m:1")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[store]\ncount = 0\n",
            r"cluster\.toml:2: store\.count: Input should be greater than or equal to 1",
        ),
        ('[master]\neviction_policy = "random"\n', r":2: master\.eviction_policy: must be one of lru"),
        ("[master]\nhigh_watermark = 0.5\nlow_watermark = 0.7\n", r":1: master: low_watermark must be <="),
        ('[store]\nsegment_size = "lots"\n', r":2: store\.segment_size: must be a size like 256MiB"),
        ('[router]\npolicy = "fastest"\n', r":2: router\.policy: must be one of cost"),
        ("[prefill]\ncount = 1\nports = 3\n", r":3: prefill\.ports: Extra inputs are not permitted"),
        ("[cluster]\nblock_size = -4\n", r":2: cluster\.block_size: Input should be greater than 0"),
        ("[cluster\n", r"cluster\.toml: invalid TOML"),
        ('[master]\nport = 0\n[decode]\nhosts = ["10.0.0.7"]\n', r"master\.port must be fixed"),
    ],
)
def test_spec_errors_name_file_line_and_field(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(InvalidArgument, match=expected):
        load_spec(_spec(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read cluster spec"):
        load_spec(tmp_path / "nope.toml")


def test_three_host_plan(tmp_path: Path) -> None:
    text = """
[master]
host = "10.0.0.1"
port = 50051
[store]
count = 2
hosts = ["10.0.0.2", "10.0.0.3"]
[prefill]
count = 2
hosts = ["10.0.0.2", "10.0.0.3"]
port = 50060
[decode]
hosts = ["10.0.0.3"]
[router]
host = "10.0.0.1"
"""
    launches = {x.name: x for x in plan(load_spec(_spec(tmp_path, text)), "kv1:float32:b64:l4:h4:d32")}
    assert launches["store1"].host == "10.0.0.3"
    assert "--listen 10.0.0.3 --port 50061" in launches["prefill1"].command("10.0.0.1:50051")
    assert "--master 10.0.0.1:50051" in launches["router"].command("10.0.0.1:50051")
    assert not launches["router"].local


def test_parse_size() -> None:
    assert parse_size("256MiB") == 256 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("12") == 12
    assert parse_size("big") is None


def test_up_rejects_a_bad_spec(tmp_path: Path) -> None:
    bad = _spec(tmp_path, "[store]\ncount = 0\n")
    r = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(bad)], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2
    assert "cluster.toml:2: store.count" in r.stderr


@pytest.mark.slow
def test_up_starts_serves_and_stops(tmp_path: Path) -> None:
    import httpx

    spec = _spec(tmp_path, """
[cluster]
block_size = 16
[master]
port = 0
[store]
count = 1
segment_size = "64MiB"
[router]
port = 0
""")  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    # every line `up` prints, read on a thread: waiting never blocks the test, the pipe never fills
    lines: list[str] = []
    assert proc.stdout is not None
    out_pipe = proc.stdout
    reader = threading.Thread(target=lambda: lines.extend(iter(out_pipe.readline, "")), daemon=True)
    reader.start()

    def tail() -> str:
        return "".join(lines[-60:])

    try:
        deadline = time.monotonic() + 200
        while not any("Ctrl-C stops everything" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "kvpool up did not start:\n" + tail()
            time.sleep(0.2)
        url = next(x.split()[1] for x in lines if x.strip().startswith("router") and "http://" in x)
        assert any(line.startswith("[prefill0] ") for line in lines)  # prefixed role logs
        metrics = [line.split("(metrics: ")[1].rstrip(")\n") for line in lines if "(metrics: http://" in line]
        assert len(metrics) == 5, tail()  # master, store0, prefill0, decode0, router
        assert "kvpool_master_nodes_alive" in httpx.get(metrics[0], timeout=10).text
        r = httpx.post(f"{url}/completions", json={"model": "kvpool-tiny-llama-l4-h256-a8-kv4-i688",
                                                   "prompt": "hello", "max_tokens": 3}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        # a store killed -9 is a fault the cluster rides out: `up` reports it, restarts it, the rest serve
        import psutil

        stores = [c for c in psutil.Process(proc.pid).children(recursive=True) if "store" in c.cmdline()]
        assert len(stores) == 1, [c.cmdline() for c in psutil.Process(proc.pid).children(recursive=True)]
        stores[0].kill()
        stores[0].wait(10)
        time.sleep(1.0)
        assert proc.poll() is None, "kvpool up stopped when one store died"
        r = httpx.post(f"{url}/completions", json={"model": "kvpool-tiny-llama-l4-h256-a8-kv4-i688",
                                                   "prompt": "hello again", "max_tokens": 3}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)  # every role is stopped within 10 s of SIGTERM, even one still starting
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("kvpool up did not stop on SIGTERM:\n" + tail()) from None
        reader.join(10)
    out = "".join(lines)
    assert proc.returncode == 0, out[-2000:]
    assert "store0 exited (signal 9 (SIGKILL)); restarting it in 1 s on the same ports" in out, out[-2000:]
    assert "kvpool cluster stopped" in out
