"""`kvpool up` gives each role its own credentials and nothing more (issue #46, items 1 and 6).

The cluster secret reaches the master and the stores only, even when the operator's environment exports
it (the natural multi-host set-up); every other role gets a join token of its own role; the router holds
the serving key, serving nodes its digest, vLLM engines the key as their API key; a wildcard listen address
is refused for nodes. The last test starts a real secured `kvpool up` and reads its children's
environments from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvpool.cluster.credentials import CREDENTIAL_ENV, UpCredentials, scrubbed, token_name
from kvpool.cluster.launch import Launch, plan
from kvpool.cluster.spec import ClusterSpec
from kvpool.membership import read_token_roles, token_digest
from kvpool.rpc.serving_key import DIGEST_ENV, KEY_FILE_ENV
from kvpool.tenants import SALT_KEY_ENV
from kvpool.types import DEFAULT_LAYOUT

SECRETS = ("KVPOOL_CLUSTER_SECRET", "KVPOOL_CLUSTER_SECRET_FILE")


def _operator(tmp_path: Path) -> dict[str, str]:
    secret = tmp_path / "operator_secret"
    secret.write_text("o" * 64 + "\n")
    secret.chmod(0o600)
    return {
        "KVPOOL_CLUSTER_SECRET_FILE": str(secret),
        "KVPOOL_JOIN_TOKEN": "operator-" + "t" * 40,
        "HOME": "/x",
    }


def _launches(spec: dict[str, object] | None = None) -> dict[str, Launch]:
    """The launch plan of `spec` (default: one of each role), by launch name."""
    return {x.name: x for x in plan(ClusterSpec.model_validate(spec or {}), DEFAULT_LAYOUT)}


def test_up_gives_the_secret_only_to_master_and_stores_even_from_the_operators_environment(
    tmp_path: Path,
) -> None:
    operator = _operator(tmp_path)
    (tmp_path / "up").mkdir()
    launches = _launches()
    creds = UpCredentials.make(tmp_path / "up", operator, launches.values())
    roles = read_token_roles(Path(creds.master_env["KVPOOL_JOIN_TOKENS_FILE"]))
    by_name = {name: role for name, role in roles.values()}
    assert by_name == {
        "admin": "admin",
        "router": "router",
        "serving-prefill0": "serving",
        "serving-decode0": "serving",
    }
    for name in ("master", "store0"):
        env = scrubbed(operator) | creds.env_for(launches[name])
        assert env["KVPOOL_CLUSTER_SECRET_FILE"] == operator["KVPOOL_CLUSTER_SECRET_FILE"], name
        assert "KVPOOL_JOIN_TOKEN" not in env and KEY_FILE_ENV not in env and "VLLM_API_KEY" not in env
    expected_token = {"router": "router", "prefill0": "serving", "decode0": "serving"}
    for name, token_role in expected_token.items():
        env = scrubbed(operator) | creds.env_for(launches[name])
        assert not set(env) & set(SECRETS), name  # the operator's secret never reaches it
        assert "KVPOOL_JOIN_TOKEN" not in env  # nor the operator's own token
        token = Path(env["KVPOOL_JOIN_TOKEN_FILE"]).read_text().strip()
        assert roles[token_digest(token)][1] == token_role, name
    key = Path(creds.caller_env[KEY_FILE_ENV]).read_text().strip()
    assert creds.env_for(launches["router"])[KEY_FILE_ENV] == creds.caller_env[KEY_FILE_ENV]
    prefill, decode = creds.env_for(launches["prefill0"]), creds.env_for(launches["decode0"])
    assert prefill[DIGEST_ENV] == token_digest(key) and KEY_FILE_ENV not in decode
    creds.remove_files()
    assert Path(operator["KVPOOL_CLUSTER_SECRET_FILE"]).exists()  # the operator's file is not ours to remove
    assert not list((tmp_path / "up").iterdir())


def test_up_gives_every_serving_node_and_engine_a_token_of_its_own(tmp_path: Path) -> None:
    """Writes and leases are bound to the token that made them (tests/test_least_privilege.py), so nodes
    sharing one could write as each other: each serving node and engine holds its own, of its role."""
    launches = _launches({"prefill": {"count": 2}, "decode": {"count": 3}})
    engines = _launches(
        {
            "prefill": {"engine": "vllm", "python": "python", "count": 2},
            "decode": {"engine": "vllm", "python": "python"},
        }
    )
    everything = [*launches.values(), *(x for x in engines.values() if x.argv)]
    creds = UpCredentials.make(tmp_path, {}, everything)
    roles = read_token_roles(Path(creds.master_env["KVPOOL_JOIN_TOKENS_FILE"]))
    members = [x for x in everything if x.role in ("prefill", "decode", "vllm-prefill", "vllm-decode")]
    assert len(members) == 8
    tokens: dict[str, str] = {}
    for launch in members:
        token = Path(creds.env_for(launch)["KVPOOL_JOIN_TOKEN_FILE"]).read_text().strip()
        name, role = roles[token_digest(token)]
        assert role == ("engine" if launch.argv else "serving"), launch.name
        assert name == f"{role}-{launch.name}" == token_name(launch)  # named after the node
        tokens[launch.name] = token
    assert len(set(tokens.values())) == len(members)  # none shared
    assert all(f"--node-id {x.name}" in " ".join(x.args) for x in members if not x.argv)
    note = creds.remote_note(launches["decode2"])
    assert str(tmp_path / "join_token.serving-decode2") in note and "serving-decode1" not in note
    with pytest.raises(KeyError, match="prefill5"):  # never a shared fallback for a node it was not given
        creds.env_for(Launch("prefill5", "prefill", "127.0.0.1"))


def test_the_commands_for_other_hosts_name_every_credential_their_role_needs(tmp_path: Path) -> None:
    launches = _launches()
    creds = UpCredentials.make(tmp_path, {}, launches.values())
    salt = {SALT_KEY_ENV: str(tmp_path / "tenant_salt_key")}
    notes = {
        name: creds.remote_note(launches[name], salt) for name in ("master", "store0", "router", "prefill0")
    }
    salt_line = f"{SALT_KEY_ENV} = a 0600 copy of {tmp_path / 'tenant_salt_key'}"
    for name in ("master", "router"):  # the two that derive tenants' salts must share the key
        assert salt_line in notes[name], notes[name]
    for name in ("store0", "prefill0"):
        assert SALT_KEY_ENV not in notes[name], notes[name]
    assert "KVPOOL_CLUSTER_SECRET_FILE" in notes["master"] and "KVPOOL_CLUSTER_SECRET_FILE" in notes["store0"]
    router = notes["router"]
    assert f"{KEY_FILE_ENV} = a 0600 copy of {creds.caller_env[KEY_FILE_ENV]}" in router
    assert f"KVPOOL_JOIN_TOKEN_FILE = a 0600 copy of {tmp_path / 'join_token.router'}" in router
    assert f"{DIGEST_ENV}=" in notes["prefill0"] and KEY_FILE_ENV not in notes["prefill0"]
    insecure = UpCredentials()  # --insecure: no secret, no tokens, but the salt key still
    assert insecure.remote_note(launches["router"], salt) == f"  ({salt_line})"
    assert insecure.remote_note(launches["store0"], salt) == ""


def test_a_wildcard_listen_address_is_refused_for_nodes() -> None:
    for section in ("prefill", "decode", "store"):
        with pytest.raises(ValidationError, match=f"{section}.hosts: a wildcard address"):
            ClusterSpec.model_validate({section: {"hosts": ["0.0.0.0"]}})
    with pytest.raises(ValidationError, match="master.host: a wildcard address"):
        ClusterSpec.model_validate({"master": {"host": "::"}})
    ClusterSpec.model_validate({"router": {"host": "0.0.0.0"}})  # the front door may face every interface


MODEL = "kvpool-tiny-llama-l4-h256-a8-kv4-i688"
SPEC = """
[cluster]
block_size = 16
[master]
port = 0
[store]
count = 1
segment_size = "64MiB"
[router]
port = 0
"""


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)


@pytest.mark.slow
def test_a_secured_up_keeps_the_operators_secret_from_non_secret_roles(tmp_path: Path) -> None:
    import httpx
    import psutil

    spec = tmp_path / "cluster.toml"
    spec.write_text(SPEC)
    operator = _operator(tmp_path)
    env = (
        {k: v for k, v in os.environ.items() if k not in CREDENTIAL_ENV}
        | operator
        | {"PYTHONUNBUFFERED": "1"}
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    assert proc.stdout is not None
    pipe = proc.stdout
    threading.Thread(target=lambda: lines.extend(iter(pipe.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not any("Ctrl-C stops everything" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-60:])
            time.sleep(0.1)
        children = {}
        for child in psutil.Process(proc.pid).children(recursive=True):
            cmd = child.cmdline()
            role = next((r for r in ("master", "store", "prefill", "decode", "router") if r in cmd), None)
            if role is not None:
                children[role] = _environ(child.pid)
        assert set(children) == {"master", "store", "prefill", "decode", "router"}, children.keys()
        for role, environ in children.items():
            has_secret = bool(set(environ) & set(SECRETS))
            assert has_secret == (role in ("master", "store")), (role, sorted(environ))
            assert environ.get("KVPOOL_JOIN_TOKEN", "") == "", role  # the operator's token stays with it
        assert children["master"]["KVPOOL_CLUSTER_SECRET_FILE"] == operator["KVPOOL_CLUSTER_SECRET_FILE"]
        assert KEY_FILE_ENV in children["router"] and KEY_FILE_ENV not in children["prefill"]
        assert DIGEST_ENV in children["prefill"] and DIGEST_ENV in children["decode"]
        own = {children[r]["KVPOOL_JOIN_TOKEN_FILE"] for r in ("prefill", "decode", "router")}
        assert len(own) == 3, own  # each node its own token
        # the cluster serves through the router (which holds the serving key) ...
        url = next(x.split()[1] for x in lines if x.startswith("  router")).removesuffix("/v1")
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL, "prompt": "hello there", "max_tokens": 3},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        # ... and a router-role token cannot run admin operations
        master = next(x.split()[1] for x in lines if x.startswith("  master"))
        admin = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "admin", "--master", master, "evict", "--fraction", "0.1"],
            capture_output=True, text=True, timeout=60,
            env=scrubbed(os.environ)
            | {"KVPOOL_JOIN_TOKEN_FILE": children["router"]["KVPOOL_JOIN_TOKEN_FILE"]}
            | {k: v for k, v in children["router"].items() if k.startswith("KVPOOL_TLS_")},
        )  # fmt: skip
        assert admin.returncode != 0 and "may not call Evict" in admin.stderr, admin.stderr[-2000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
