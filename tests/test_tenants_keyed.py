"""Tenants' salts are keyed (issue 46, item 1): HMAC-SHA256 under the salt key the router and master hold,
so a tenant's name does not give its salt; a tenants file readable by others, an empty salt, and a derived
salt without a key are refused."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import pytest

from kvpool.errors import InvalidArgument
from kvpool.tenants import Tenants, tenant_id
from tests.tenant_files import SALT_KEY, salt_key_file, write_private

ONE = '[[tenants]]\nname = "acme"\napi_keys = ["sk-acme"]\n'


def _salt(tenants: Tenants, key: str) -> str:
    return tenants.cache_salt(tenants.authenticate(key))


def test_a_tenants_salt_depends_on_the_key_not_only_on_its_name(tmp_path: Path) -> None:
    f = write_private(tmp_path / "t.toml", ONE)
    a = _salt(Tenants.load(f, SALT_KEY), "sk-acme")
    b = _salt(Tenants.load(f, b"another-salt-key-0123456789"), "sk-acme")
    assert a != b and len(a) == len(b) == 32
    assert a == _salt(Tenants.load(f, SALT_KEY), "sk-acme")  # stable for one key (routers, master)
    assert Tenants.load(f, SALT_KEY).ids() == {"acme": tenant_id(a)}  # metrics' opaque id: of the salt
    unkeyed = {  # what the name alone gives: the old unkeyed digest, plain hashes, an empty key
        hashlib.blake2b(b"acme", digest_size=16, person=b"kvpool-tenant").hexdigest(),
        hashlib.sha256(b"acme").hexdigest()[:32],
        hmac.new(b"", b"kvpool-tenant-salt\0acme", hashlib.sha256).hexdigest()[:32],
    }
    assert a not in unkeyed and b not in unkeyed


def test_a_derived_salt_without_a_key_is_refused(tmp_path: Path) -> None:
    f = write_private(tmp_path / "t.toml", ONE)
    with pytest.raises(InvalidArgument, match="no salt key is given.*KVPOOL_TENANT_SALT_KEY_FILE"):
        Tenants.load(f)
    explicit = write_private(tmp_path / "e.toml", ONE + 'cache_salt = "chosen-by-the-operator"\n')
    assert _salt(Tenants.load(explicit), "sk-acme") == "chosen-by-the-operator"  # no key needed


def test_an_empty_salt_is_refused(tmp_path: Path) -> None:
    """ "" is the single-tenant namespace: a tenant given it would share every open router's blocks."""
    f = write_private(tmp_path / "t.toml", ONE + 'cache_salt = ""\n')
    with pytest.raises(InvalidArgument, match=r"t\.toml: tenants\.0\.cache_salt"):
        Tenants.load(f, SALT_KEY)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_tenants_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    f = write_private(tmp_path / "t.toml", ONE)
    assert Tenants.load(f, SALT_KEY).required
    os.chmod(f, mode)
    with pytest.raises(InvalidArgument, match=f"mode {mode:04o}.*chmod 600"):
        Tenants.load(f, SALT_KEY)


def test_a_tenants_file_readable_by_others_stops_the_router_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    f = tmp_path / "t.toml"
    f.write_text(ONE + 'cache_salt = "s"\n')
    os.chmod(f, 0o644)
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "router", "--port", "0", "--block-size", "64",
         "--master", "127.0.0.1:1", "--tenants", str(f)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out  # a node that cannot start: one line, exit 1 (README)
    assert "Traceback" not in out.stderr and f"chmod 600 {f}" in out.stderr, out.stderr


def test_kvpool_up_generates_a_private_salt_key_for_the_router_and_master(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpool.cli.up_cmd import _tenant_salt_env
    from kvpool.tenants import SALT_KEY_ENV, load_salt_key

    monkeypatch.delenv(SALT_KEY_ENV, raising=False)
    env = _tenant_salt_env(tmp_path)
    path = Path(env[SALT_KEY_ENV])
    assert os.stat(path).st_mode & 0o777 == 0o600 and len(load_salt_key(path)) >= 32
    monkeypatch.setenv(SALT_KEY_ENV, str(path))  # the operator's own key: kept (hosts must share it)
    assert _tenant_salt_env(tmp_path / "other") == {SALT_KEY_ENV: str(path)}
    assert not (tmp_path / "other").exists()
    from kvpool.cluster.credentials import scrubbed

    assert SALT_KEY_ENV not in scrubbed({SALT_KEY_ENV: str(path)})  # other roles never inherit it


def test_the_salt_key_file_must_be_private(tmp_path: Path) -> None:
    from kvpool.tenants import load_salt_key

    key = salt_key_file(tmp_path)
    assert load_salt_key(key) == SALT_KEY
    os.chmod(key, 0o640)
    with pytest.raises(InvalidArgument, match="chmod 600"):
        load_salt_key(key)
    write_private(key, "short")
    with pytest.raises(InvalidArgument, match="at least 16 bytes"):
        load_salt_key(key)


def test_a_salt_key_of_raw_random_bytes_is_a_key(tmp_path: Path) -> None:
    from kvpool.tenants import load_salt_key

    raw = bytes([0xA1, 0xFF, 0x00, 0x80]) * 8  # not UTF-8 (head -c 32 /dev/urandom)
    f = tmp_path / "raw.key"
    f.write_bytes(raw)
    os.chmod(f, 0o600)
    assert load_salt_key(f) == raw
    (tmp_path / "hex.key").write_text("  " + "ab" * 16 + "\n")
    os.chmod(tmp_path / "hex.key", 0o600)
    assert load_salt_key(tmp_path / "hex.key") == b"ab" * 16  # text keys: whitespace stripped
