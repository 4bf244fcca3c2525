"""Tenants: API keys → tenant → KV cache salt, decided on the server (field case B09).

A tenants file (TOML, mode 0600: a file readable by group or others is refused, it holds API keys) lists
each tenant's API keys and, optionally, its cache salt:

    [[tenants]]
    name = "acme"
    api_keys = ["sk-acme-1", "sk-acme-2"]
    # cache_salt = "..."   # default: HMAC-SHA256 of the name under the salt key (below); never empty
    # pool_quota_blocks = 10000   # default: no quota (see kvpool.master.quotas)

The salt goes into the namespace, so two tenants never share a block and one tenant's hits cannot be
timed by another. A tenant's default salt is keyed: HMAC-SHA256 under the **salt key** (a 0600 file of at
least 16 bytes, `tenant_salt_key_file` / `KVPOOL_TENANT_SALT_KEY_FILE`; `kvpool up` generates one), which
the router and the master hold, so knowing a tenant's name does not give its salt. A file whose tenants
need a derived salt is refused without a salt key. A client may send its own `cache_salt` (to partition
further within its tenant): it is *appended* to the tenant's salt, never used instead of it, so no request
can reach another tenant's namespace. Without a tenants file the router is single-tenant: any key (or
none) is accepted, salt "".

Metrics name a tenant by its opaque id (`tenant_id`: a short digest of its salt), never by its name.

The router re-reads the file when it changes (`Tenants.refresh`, at most every `RELOAD_CHECK_S`): a file
that no longer loads leaves the tenants as they were (logged). The master reads the same file (`kvpool
master` setting `tenants`) for the per-tenant pool quotas, keyed by cache salt
(`Tenants.with_pool_quota`); the router ignores them.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvpool.errors import InvalidArgument

log = logging.getLogger(__name__)

SALT_KEY_ENV = "KVPOOL_TENANT_SALT_KEY_FILE"
"""The variable naming the salt key file (the router's and master's `tenant_salt_key_file` setting)."""
MIN_SALT_KEY_BYTES = 16
RELOAD_CHECK_S = 0.5
"""How often at most `Tenants.refresh` looks at the file's modification time (seconds)."""


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    api_keys: list[str] = Field(min_length=1)
    cache_salt: str | None = Field(default=None, min_length=1)  # "" is the single-tenant namespace
    pool_quota_blocks: int | None = Field(default=None, ge=1)


class _TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: list[_TenantEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> _TenantsFile:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        keys = [k for t in self.tenants for k in t.api_keys]
        if len(set(keys)) != len(keys) or any(not k for k in keys):
            raise ValueError("API keys must be non-empty and belong to one tenant each")
        if any(t.cache_salt is not None and "/" in t.cache_salt for t in self.tenants):
            raise ValueError("a cache_salt must not contain '/' (it separates a client's sub-salt)")
        return self


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    cache_salt: str
    pool_quota_blocks: int | None = None
    """At most this many blocks of the pool under the tenant's namespaces (None: no quota)."""

    @property
    def tenant_id(self) -> str:
        """The opaque id metrics name the tenant by (`tenant_id`)."""
        return tenant_id(self.cache_salt)


OPEN_TENANT = Tenant(name="default", cache_salt="")


def tenant_salt(cache_salt: str) -> str:
    """The tenant's part of a namespace's cache salt (a client's sub-salt follows the first "/")."""
    return cache_salt.split("/", 1)[0]


def tenant_id(cache_salt: str) -> str:
    """A tenant's opaque id: 12 hex digits of a digest of its salt (keyed, or chosen by the operator), so
    metrics neither name the tenant nor reveal its salt."""
    return hashlib.blake2b(cache_salt.encode(), digest_size=6, person=b"kvpool-tenantid").hexdigest()


def derived_salt(name: str, salt_key: bytes) -> str:
    """The default salt of tenant `name`: HMAC-SHA256 under `salt_key` (32 hex digits)."""
    return hmac.new(salt_key, b"kvpool-tenant-salt\0" + name.encode(), hashlib.sha256).hexdigest()[:32]


def _private_file(p: Path, what: str) -> bytes:
    """`p`'s bytes; `InvalidArgument` when it cannot be read or is readable or writable by group or others."""
    try:
        mode = p.stat().st_mode
        if mode & 0o077:
            raise InvalidArgument(
                f"{p}: the {what} is readable or writable by group or others (mode "
                f"{stat.S_IMODE(mode):04o}): chmod 600 {p}"
            )
        return p.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{p}: cannot read {what}: {exc.strerror}") from None


def load_salt_key(path: str | Path) -> bytes:
    """The salt key in a 0600 file, at least 16 bytes: its text with surrounding whitespace stripped (what
    `new_salt_key_file` writes), or its raw bytes when they are not UTF-8 text (`head -c 32 /dev/urandom`).
    `InvalidArgument` naming the file otherwise."""
    p = Path(path)
    raw = _private_file(p, "salt key file")
    try:
        key = raw.decode().strip().encode()
    except UnicodeDecodeError:
        key = raw
    if len(key) < MIN_SALT_KEY_BYTES:
        raise InvalidArgument(f"{p}: the salt key must be at least {MIN_SALT_KEY_BYTES} bytes")
    return key


def new_salt_key_file(directory: str | Path) -> Path:
    """A fresh random 256-bit salt key in a new 0600 file `tenant_salt_key` under `directory`."""
    path = Path(directory) / "tenant_salt_key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def _parse(p: Path, salt_key: bytes | None) -> dict[str, Tenant]:
    """API key -> tenant, from the tenants file `p`; `InvalidArgument` naming the file and the field."""
    try:
        data = tomllib.loads(_private_file(p, "tenants file").decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{p}: {exc}") from None
    try:
        parsed = _TenantsFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise InvalidArgument(f"{p}: {where}: {first['msg']}") from None
    by_key = {}
    for t in parsed.tenants:
        if t.cache_salt is None and salt_key is None:
            raise InvalidArgument(
                f"{p}: tenant {t.name!r} has no cache_salt and no salt key is given: set "
                f"tenant_salt_key_file (--salt-key-file, {SALT_KEY_ENV}; a 0600 file of at least "
                f"{MIN_SALT_KEY_BYTES} random bytes), or give the tenant a cache_salt"
            )
        salt = t.cache_salt if t.cache_salt is not None else derived_salt(t.name, salt_key or b"")
        tenant = Tenant(t.name, salt, t.pool_quota_blocks)
        by_key.update(dict.fromkeys(t.api_keys, tenant))
    salts = {t.cache_salt for t in by_key.values()}
    if len(salts) != len({t.name for t in by_key.values()}):
        raise InvalidArgument(f"{p}: tenants must have distinct cache salts")
    return by_key


def _version(path: Path | None) -> tuple[int, ...] | None:
    """What tells a changed file: (modification and change times in ns, size, inode, mode); the change time
    moves on a chmod, so a file refused for its mode is read again once fixed. None without one."""
    try:
        st = path.stat() if path is not None else None
    except OSError:
        return None
    if st is None:
        return None
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino, st.st_mode)


class Tenants:
    """Resolves API keys. `authenticate` → a `Tenant` or None (unknown key: the caller answers 401)."""

    def __init__(
        self, by_key: dict[str, Tenant] | None, *, path: Path | None = None, salt_key: bytes | None = None
    ) -> None:
        self._by_key = by_key
        self._path, self._salt_key = path, salt_key
        self._seen = _version(path)
        self._next_check = time.monotonic() + RELOAD_CHECK_S
        self._lock = threading.Lock()

    @classmethod
    def open(cls) -> Tenants:
        """Single tenant: every request, with any key or none, is the default tenant (salt "")."""
        return cls(None)

    @classmethod
    def load(cls, path: str | Path, salt_key: bytes | None = None) -> Tenants:
        """Read a tenants file (mode 0600); a tenant without a `cache_salt` needs `salt_key`.
        `InvalidArgument` naming the file and the field on any error."""
        p = Path(path)
        before = _version(p)  # taken before the read: a change during it is seen by the next `refresh`
        tenants = cls(_parse(p, salt_key), path=p, salt_key=salt_key)
        tenants._seen = before
        return tenants

    @classmethod
    def from_settings(cls, tenants: str | None, salt_key_file: str | None) -> Tenants:
        """`load` with the key of `salt_key_file` (None: no key), or `open()` without a tenants file."""
        if not tenants:
            return cls.open()
        return cls.load(tenants, load_salt_key(salt_key_file) if salt_key_file else None)

    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the file if it changed since it was read (looked at most every `RELOAD_CHECK_S` unless
        `force`); True when new tenants took effect. A file that no longer loads keeps the old tenants."""
        if self._path is None or (not force and time.monotonic() < self._next_check):
            return False
        with self._lock:
            self._next_check = time.monotonic() + RELOAD_CHECK_S
            version = _version(self._path)
            if version == self._seen:
                return False
            self._seen = version
            if version is None:
                log.error("tenants file %s is gone; the previous tenants stay until it is back", self._path)
                return False
            try:
                self._by_key = _parse(self._path, self._salt_key)
            except InvalidArgument as exc:
                log.error("tenants file changed but not reloaded, the previous tenants stay: %s", exc)
                return False
        log.info("tenants file %s reloaded: %d API keys", self._path, len(self._by_key))
        return True

    def ids(self) -> dict[str, str]:
        """Tenant name -> its opaque id in metrics (`tenant_id`), for the operator to read /metrics by."""
        return {t.name: t.tenant_id for t in (self._by_key or {}).values()}

    def with_pool_quota(self) -> dict[str, Tenant]:
        """Cache salt -> tenant, for the tenants that have a pool quota."""
        tenants = (self._by_key or {}).values()
        return {t.cache_salt: t for t in tenants if t.pool_quota_blocks is not None}

    @property
    def required(self) -> bool:
        """True when requests must carry a known API key."""
        return self._by_key is not None

    def authenticate(self, api_key: str | None) -> Tenant | None:
        """The tenant of `api_key` (the file re-read first if it changed), None for an unknown key."""
        if self._by_key is None:
            return OPEN_TENANT
        self.refresh()
        return self._by_key.get(api_key or "")

    @staticmethod
    def cache_salt(tenant: Tenant | None, client_salt: str = "") -> str:
        """The namespace salt of a request: the tenant's, with an optional client salt appended."""
        if tenant is None:
            raise InvalidArgument("no tenant")
        if not client_salt:
            return tenant.cache_salt
        sub = hashlib.blake2b(client_salt.encode(), digest_size=16, person=b"kvpool-subsalt").hexdigest()
        return f"{tenant.cache_salt}/{sub}"
