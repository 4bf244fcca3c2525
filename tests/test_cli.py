"""The `kvpool` command line: help is fast (no torch, grpc or ucxx imported) and every role is listed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvpool.cli.main import app


def test_help_imports_no_heavy_module() -> None:
    code = (
        "import sys; from typer.testing import CliRunner; from kvpool.cli.main import app; "
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
        "heavy = [m for m in ('torch', 'grpc', 'ucxx', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_role_is_a_command() -> None:
    out = CliRunner().invoke(app, ["--help"]).output
    for command in ("demo", "master", "store", "prefill", "decode", "router", "up", "admin", "bench"):
        assert command in out


def test_bad_flag_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["demo", "--no-such-flag"])
    assert result.exit_code == 2
    assert "No such option" in result.output


def test_bad_setting_is_one_line_not_a_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "store", "--segment-size", "12XB"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "invalid setting segment_size" in out.stderr and "malformed size" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_offline_only_eviction_policy_is_refused_by_a_live_master() -> None:
    """`master --policy opt` started (a new-user pass) and ran as LRU: nothing feeds it next-use times."""
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "master", "--policy", "opt"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "opt is offline-only" in out.stderr, out.stderr


def test_a_device_torch_cannot_name_is_a_bad_setting() -> None:
    """It was torch's raw RuntimeError, after the node had loaded and opened its ports (a new-user pass)."""
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "prefill", "--device", "bogus", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "invalid setting device: 'bogus' is not a torch device" in out.stderr
    assert "RuntimeError" not in out.stderr, out.stderr


def test_a_segment_larger_than_the_hosts_memory_is_refused() -> None:
    """It was accepted (a new user's `--segment-size 1TiB` on a 23 GiB host registered 4 M slots, and the
    master would have placed blocks there until the host ran out of memory)."""
    import psutil

    too_big = f"{(psutil.virtual_memory().total >> 30) + 1}GiB"
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "store", "--segment-size", too_big],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "more than this host's memory" in out.stderr, out.stderr


def _kvpool(*args: str, wide: bool = False) -> subprocess.CompletedProcess[str]:
    """`kvpool ARGS`; `wide`: a usage error's box is one line per message (no wrapping)."""
    env = {**os.environ, "COLUMNS": "1000"} if wide else None
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", *args], capture_output=True, text=True, timeout=120, env=env
    )


def _one_error_line(out: subprocess.CompletedProcess[str], prefix: str) -> str:
    lines = [line for line in out.stderr.splitlines() if " INFO " not in line and " WARNING " not in line]
    assert "Traceback" not in out.stderr, out.stderr
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    return lines[0]


def test_serving_roles_fail_to_start_with_one_line() -> None:
    """A role that cannot start (bad device, missing model, unreachable master) says why in one line and
    exits 1; a malformed master address or routing policy is a bad setting (exit 2)."""
    out = _kvpool("prefill", "--model", "/nonexistent/model", "--master", "127.0.0.1:1")
    assert out.returncode == 1 and "no config.json" in _one_error_line(out, "kvpool prefill: NotFound")
    out = _kvpool("decode", "--master", "127.0.0.1:1", "--port", "0", "--master-wait-s", "0")
    assert out.returncode == 1 and "127.0.0.1:1" in _one_error_line(out, "kvpool decode: Unavailable")
    out = _kvpool("prefill", "--master", "nohost")
    assert out.returncode == 2 and "HOST:PORT" in _one_error_line(out, "kvpool: invalid setting master")
    out = _kvpool("router", "--policy", "fastest")
    assert out.returncode == 2 and "round-robin" in _one_error_line(out, "kvpool: invalid setting policy")


def test_admin_refuses_a_bad_master_address_and_timeout() -> None:
    result = CliRunner().invoke(app, ["admin", "--master", "127.0.0.1:99999", "status"])
    assert result.exit_code == 2 and "1-65535" in result.output
    result = CliRunner().invoke(app, ["admin", "--timeout", "-1", "status"])
    assert result.exit_code == 2 and "must be > 0" in result.output
    for timeout in ("inf", "nan"):  # inf was a DeadlineExceeded at once (exit 1), nan a usage error already
        result = CliRunner().invoke(app, ["admin", "--master", "127.0.0.1:1", "--timeout", timeout, "status"])
        assert result.exit_code == 2 and "Invalid value for '--timeout'" in result.output, result.output


def test_default_layouts_serve_the_default_model() -> None:
    """`kvpool master` and `kvpool store` with no --layout accept the default prefill/decode node."""
    from kvpool.master.settings import MasterSettings
    from kvpool.model.runner import load_runner
    from kvpool.store.settings import StoreSettings
    from kvpool.types import DEFAULT_LAYOUT

    assert MasterSettings().layout == StoreSettings().layout == DEFAULT_LAYOUT
    assert load_runner().layout.fingerprint() == DEFAULT_LAYOUT


def test_bench_ttft_refuses_a_non_positive_request_count() -> None:
    """Checked before any cluster starts (it used to start one, then fail with an IndexError)."""
    result = CliRunner().invoke(app, ["bench", "ttft", "--requests", "0"])
    assert result.exit_code == 2 and "--requests" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "transfer", "--reps", "0"],  # ran the default count
        ["bench", "transfer", "--reps", "-1"],  # ran everything and reported no measurement
        ["bench", "transfer", "--batch", "0"],
        ["bench", "transfer", "--blocks-per-message", "5000"],
        ["demo", "--questions", "9"],  # silently ran 5
        ["demo", "--conversations", "0"],
        ["demo", "--max-tokens", "0"],
        ["demo", "--trace-block-tokens", "0"],  # started the cluster, then every chat prompt was empty
        ["demo", "--trace-block-tokens", "-5"],  # a numpy traceback
    ],
)
def test_out_of_range_counts_are_refused_before_anything_starts(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Invalid value" in result.output


def test_demo_refuses_a_missing_or_malformed_trace_before_anything_starts(tmp_path) -> None:
    """Found by a new-user pass: a FileNotFoundError / ValueError traceback (exit 1); now a usage error
    naming the file (and the line), as `kvpool bench trace` says it."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [0]}\nnot json\n')
    for trace, expected in (
        ("/nonexistent.jsonl", "/nonexistent.jsonl: cannot read trace"),
        (str(bad), ":2: not JSON"),
    ):
        out = _kvpool("demo", "--trace", trace, wide=True)
        assert out.returncode == 2 and expected in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and "starting a local cluster" not in out.stdout, out.stdout


UNUSABLE_DEVICE = "cuda:99"  # torch names it; no machine of ours can use it (no CUDA, or fewer GPUs)


def test_a_device_this_machine_cannot_use_is_a_bad_setting(tmp_path) -> None:
    """Found by a new-user pass: `prefill --device cuda` on CPU-only torch was `AssertionError: Torch not
    compiled with CUDA enabled` (exit 1); `bench ttft` / `demo` found out only after their cluster started."""
    out = _kvpool("prefill", "--master", "127.0.0.1:1", "--port", "0", "--device", UNUSABLE_DEVICE)
    line = _one_error_line(
        out, "kvpool: invalid setting device: 'cuda:99' is a torch device this machine cannot use"
    )
    assert out.returncode == 2, line
    for cmd in (["bench", "ttft"], ["demo"]):
        out = _kvpool(*cmd, "--device", UNUSABLE_DEVICE, wide=True)
        assert out.returncode == 2 and "this machine cannot use" in out.stderr, out.stderr
        assert "Invalid value for '--device'" in out.stderr and "local cluster" not in out.stdout + out.stderr
    spec = tmp_path / "cluster.toml"
    spec.write_text(f'[cluster]\ndevice = "{UNUSABLE_DEVICE}"\n')
    out = _kvpool("up", "-c", str(spec))
    assert out.returncode == 2, out.stderr
    assert _one_error_line(
        out, f"kvpool up: {spec}: cluster.device: 'cuda:99' is a torch device this machine"
    )


def test_bench_ttft_refuses_an_unknown_transport_and_a_too_long_prompt_before_starting() -> None:
    """Found by a new-user pass: `--transport foo` ran (as auto); `--prefix-tokens 40000` failed only once the
    cluster was up (`the limit is 32768`, while the router said 32767)."""
    result = CliRunner().invoke(app, ["bench", "ttft", "--transport", "foo"])
    assert result.exit_code == 2 and "Invalid value for '--transport'" in result.output, result.output
    out = _kvpool("bench", "ttft", "--prefix-tokens", "40000", wide=True)
    assert out.returncode == 2 and "40050 tokens" in out.stderr and "the limit is 32767 tokens" in out.stderr
    assert "local cluster" not in out.stdout + out.stderr and "Traceback" not in out.stderr


def test_bench_burst_refuses_a_prefix_shorter_than_a_block() -> None:
    """Found by a new-user pass: `--prefix-tokens 10` ran a pull arm with nothing to pull and reported
    against the target."""
    result = CliRunner().invoke(app, ["bench", "burst", "--prefix-tokens", "10"])
    assert result.exit_code == 2 and "Invalid value for '--prefix-tokens'" in result.output, result.output
    assert "no full block of 64" in result.output


def test_the_nodes_and_the_router_have_one_prompt_limit() -> None:
    """One rule (`prompt_token_limit`): the nodes said 32768 where the router said 32767 (the model's
    context less the first output token)."""
    from kvpool.model.settings import model_context_len
    from kvpool.prompt import prompt_token_limit
    from kvpool.router.model_info import ModelInfo
    from kvpool.router.settings import RouterSettings
    from kvpool.serving.common import ServingSettings

    context = model_context_len(None)
    assert context == ModelInfo.load(None, block_size=64).max_model_len
    node = prompt_token_limit(ServingSettings().max_prompt_tokens, context)
    assert node == prompt_token_limit(RouterSettings().max_prompt_tokens, context) == 32767


def test_admin_economics_over_a_window_without_traffic_has_no_verdict() -> None:
    """Found by a new-user pass: an idle master got `verdict: does not pay: the pool saves 0% ...` (so did
    `kvpool bench economics --master`)."""
    import json

    from kvpool.master.procs import start_master

    master = start_master()
    try:
        base = [
            "admin",
            "--master",
            master.grpc_address,
            "economics",
            "--model-params",
            "8e9",
            "--window",
            "0.2",
        ]
        table, as_json = _kvpool(*base, wide=True), _kvpool(*base, "--json")
        bench = _kvpool("bench", "economics", "--master", master.grpc_address, "--window", "0.2", wide=True)
    finally:
        master.kill()
    assert table.returncode == 0 and "no traffic in the 0.2 s window" in table.stdout, table.stdout
    assert "does not pay" not in table.stdout
    report = json.loads(as_json.stdout)
    assert report["verdict"].startswith("no traffic in the 0.2 s window"), report
    assert report["verdict"].endswith("no verdict"), report
    assert report["share_prefill_flop_saved"] is None and report["hit_rate_window"] is None
    assert bench.returncode == 0 and "verdict: no traffic in the 0.2 s window" in bench.stdout, bench.stdout


def test_a_store_that_cannot_start_says_why_in_one_line() -> None:
    """Found by a new-user pass: out-of-range ports wrapped around (grpc) or raised an OverflowError
    traceback (UCX data port), and a missing config file or a too-small segment printed tracebacks."""
    out = _kvpool("store", "--grpc-port", "-5")
    assert out.returncode == 2 and "greater than or equal to 0" in _one_error_line(
        out, "kvpool: invalid setting grpc_port"
    )
    out = _kvpool("store", "--data-port", "70000")
    assert out.returncode == 2 and "65535" in _one_error_line(out, "kvpool: invalid setting data_port")
    out = _kvpool("store", "--master", "nohostport")
    assert out.returncode == 2 and "HOST:PORT" in _one_error_line(out, "kvpool: invalid setting master")
    out = _kvpool("store", "--config", "/nonexistent.toml")
    assert out.returncode == 2 and "not found" in _one_error_line(out, "kvpool store: FileNotFoundError")
    out = _kvpool("store", "--segment-size", "1KiB")
    assert out.returncode == 2 and "cannot hold" in _one_error_line(out, "kvpool store: InvalidArgument")


@pytest.mark.parametrize(
    ("command", "defaults"),
    [
        (
            "store",
            ["[default: 127.0.0.1]", "[default: 256MiB]", "[default: auto]", "[default: share-segment]"],
        ),
        ("master", ["[default: 127.0.0.1]", "[default: 50051]", "[default: 10000]", "[default: tail]"]),
        ("router", ["[default: 127.0.0.1:50051]", "[default: 8000]", "[default: cost]", "[default: kvpool]"]),
    ],
)
def test_store_and_master_help_show_the_built_in_defaults(command: str, defaults: list[str]) -> None:
    """Found by a new-user pass: their options default to None (so an unset flag leaves TOML and
    `KVPOOL_*` values alone) and their help showed no default at all."""
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for default in defaults:
        assert default in result.output, (default, result.output)
    # the defaults are shown, not applied: an unset flag still leaves the settings to TOML and env
    import typer

    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    with cmd.make_context(command, ["--help"], resilient_parsing=True) as ctx:
        cmd.get_help(ctx)
    assert all(p.default is None for p in cmd.params if p.name != "help"), cmd.params
    result = CliRunner().invoke(app, ["store"], env={"KVPOOL_SEGMENT_SIZE": "1KiB"})
    assert result.exit_code == 2 and "cannot hold" in result.output  # the env value, not 256MiB


def test_master_port_out_of_range_names_the_option_not_the_settings_class() -> None:
    """Found by a new-user pass: `kvpool master --port -5` said `invalid setting MasterSettings: ...`."""
    out = _kvpool("master", "--port", "-5")
    line = _one_error_line(out, "kvpool: invalid setting port:")
    assert out.returncode == 2 and "greater than or equal to 0" in line and "MasterSettings" not in line
    out = _kvpool("master", "--metrics-port", "70000")
    line = _one_error_line(out, "kvpool: invalid setting metrics_port:")
    assert out.returncode == 2 and "65535" in line
    out = _kvpool("master", "--low-watermark", "0.95")  # a check across fields names the fields
    line = _one_error_line(out, "kvpool: invalid settings: need 0 < low_watermark")
    assert out.returncode == 2 and "MasterSettings" not in line
    assert "--low-watermark" in line and "got 0.95 and 0.9" in line, line  # the flags and the values


@pytest.mark.parametrize("tokens", ["a,b", "1,-2", "1,2.5", ",", "1,4294967296"])
def test_admin_match_refuses_malformed_token_ids_before_calling_the_master(tokens: str) -> None:
    """Found by a new-user pass: `kvpool admin match a,b` printed `invalid literal for int() with base 10`."""
    result = CliRunner().invoke(app, ["admin", "--master", "127.0.0.1:1", "match", tokens])
    assert result.exit_code == 2, result.output
    assert "TOKENS" in result.output and "comma-separated integer token ids" in result.output
    assert "invalid literal" not in result.output and "Unavailable" not in result.output


@pytest.mark.parametrize(
    ("args", "option", "expected"),
    [
        (["evict", "--fraction", "2"], "--fraction", "must be in (0, 1], got 2.0"),
        (["evict", "--fraction", "0"], "--fraction", "must be in (0, 1], got 0.0"),
        (["evict", "--fraction", "-0.5"], "--fraction", "must be in (0, 1]"),
        (["evict", "--fraction", "nan"], "--fraction", "must be in (0, 1], got nan"),
        (["economics", "--model-params", "nan"], "--model-params", "must be > 0, got nan"),
        (["economics", "--model-params", "-8e9"], "--model-params", "must be > 0"),
        (["economics", "--model-params", "1e9", "--window", "inf"], "--window", "must be > 0, got inf"),
        (["economics", "--model-params", "1e9", "--layers", "-1"], "--layers", "must be >= 0, got -1"),
        (["economics", "--model-params", "1e9", "--d-attn", "-64"], "--d-attn", "must be >= 0, got -64"),
        (["economics", "--model-params", "1e9", "--mfu", "1.5"], "--mfu", "must be in (0, 1], got 1.5"),
        (["economics", "--model-params", "1e9", "--gpu", "X"], "--gpu", "unknown GPU 'X'"),
        (["set-version", "--model", "m", "--version", ""], "--version", "must not be empty"),
        (["invalidate", "--namespace", "abc"], "--namespace", "must be 32 hex characters"),
        (["invalidate", "--namespace", ""], "--namespace", "must be 32 hex characters"),
        (["invalidate", "--namespace", "ab" * 15], "--namespace", "must be 32 hex characters"),
        (["match", "--namespace", "ab" * 15, "1,2"], "--namespace", "must be 32 hex characters"),
        (
            ["match", "--namespace", "ab" * 16, "--salt", "x", "1,2"],
            "--salt",
            "not --namespace",
        ),  # was ignored
        (["set-version", "--model", " ", "--version", "v2"], "--model", "must not be empty"),
    ],
)
def test_admin_out_of_range_numbers_are_usage_errors_before_calling_the_master(
    args: list[str], option: str, expected: str
) -> None:
    """Found by a new-user pass: `kvpool admin evict --fraction 2` went to the master and exited 1 like a
    runtime failure (NaN did too; `economics --model-params nan` or `--window inf` got as far as the
    master). Now exit 2 naming the option, and no call (a master on port 1 would be `Unavailable`)."""
    result = CliRunner().invoke(app, ["admin", "--master", "127.0.0.1:1", "--timeout", "0.5", *args])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and expected in result.output, result.output
    assert "Unavailable" not in result.output and "Traceback" not in result.output


def test_a_bad_boolean_setting_lists_the_accepted_values() -> None:
    """Found by a new-user pass: `KVPOOL_SHARE_SEGMENT=maybe` said only `unable to interpret input`."""
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "store"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "KVPOOL_SHARE_SEGMENT": "maybe"},
    )  # fmt: skip
    line = _one_error_line(out, "kvpool: invalid setting share_segment:")
    assert out.returncode == 2
    for accepted in ("true/false", "yes/no", "on/off", "1/0", "'maybe'"):
        assert accepted in line, line


@pytest.mark.parametrize("cmd", [["demo"], ["bench", "ttft"]])
def test_a_missing_model_is_one_line_not_a_traceback(cmd: list[str]) -> None:
    """Found by a new-user pass: `kvpool demo/up/bench ttft --model /nonexistent` printed a 41-line
    traceback (prefill nodes already said it in one line); every kvpool error now does (-v: traceback)."""
    out = _kvpool(*cmd, "--model", "/nonexistent/model")
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and "kvpool: NotFound: no config.json" in out.stderr, out.stderr


def test_a_router_whose_layout_the_master_refuses_does_not_start() -> None:
    """A new-user pass started `kvpool router --block-size 32` against a pool of 64-token blocks: it printed
    KVPOOL_READY and served, logging on every request that the master refused its namespace (no peek could
    hit). Now one line and exit 1, as the README says."""
    from kvpool.master.procs import start_master
    from kvpool.types import DEFAULT_LAYOUT

    master = start_master(layout=DEFAULT_LAYOUT)  # 64-token blocks, the embedded model's layout
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "router", "--master", master.grpc_address, "--port", "0",
             "--block-size", "32"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        master.kill()
    assert out.returncode == 1 and "KVPOOL_READY" not in out.stdout, out.stdout + out.stderr
    assert "refuses this router's KV layout" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_version_flag() -> None:
    """Found by a new-user pass: there was no `kvpool --version`."""
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "--version"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == f"kvpool {version('kvpool')}", out


def test_help_shows_flags_as_flags_and_no_stray_markup() -> None:
    """`<bool>` beside a plain flag read as if it took a value; `[default: ...]` inside a help text was eaten
    as rich markup and left `HOST:PORT .`."""
    up = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "200"}).output
    assert "--insecure" in up and "--quiet" in up and "<bool>" not in up, up
    assert "<float>" in up and "<path>" in up  # options that take a value keep their type
    router = CliRunner().invoke(app, ["router", "--help"], env={"COLUMNS": "200"}).output
    assert "Master HOST:PORT (HOST:PORT,HOST:PORT...: masters in HA). [default: 127.0.0.1:50051]" in router
    assert " ." not in router, router


def test_router_and_demo_refuse_an_unknown_engine_alike() -> None:
    for args, option in (
        (["router", "--engines", "foo"], "--engines"),
        (["demo", "--engine", "foo"], "--engine"),
    ):
        result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
        assert result.exit_code == 2, result.output
        assert f"Invalid value for '{option}': must be kvpool or vllm, got 'foo'" in result.output, (
            result.output
        )


def test_a_port_in_use_is_one_plain_line_naming_it() -> None:
    """gRPC's C-core log (`add_port.cc ... Address already in use`) and a RuntimeError used to say it."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _kvpool("master", "--port", str(port))
        line = _one_error_line(out, "kvpool master: ")
        assert out.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in line, line
        out = _kvpool("store", "--grpc-port", str(port))
        line = _one_error_line(out, "kvpool store: ")
        assert out.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in line, line


def test_layout_prints_the_fingerprint_a_master_needs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvpool.types import DEFAULT_LAYOUT, KVLayout

    out = _kvpool("layout")
    assert out.returncode == 0 and out.stdout.strip() == DEFAULT_LAYOUT, out
    out = _kvpool("layout", "--block-size", "16")
    assert KVLayout.from_fingerprint(out.stdout.strip()).block_size == 16, out
    out = _kvpool("layout", "--model", str(tmp_path / "missing"))
    assert out.returncode == 1 and "no config.json" in _one_error_line(out, "kvpool layout: ")
