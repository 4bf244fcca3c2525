"""Tenants: API keys → tenant → KV cache salt, decided on the server (field case B09).

A tenants file (TOML) lists each tenant's API keys and, optionally, its cache salt:

    [[tenants]]
    name = "acme"
    api_keys = ["sk-acme-1", "sk-acme-2"]
    # cache_salt = "..."   # default: a digest of the name (stable across restarts and routers)
    # pool_quota_blocks = 10000   # default: no quota (see kvpool.master.quotas)

The salt goes into the namespace, so two tenants never share a block and one tenant's hits cannot be
timed by another. A client may send its own `cache_salt` (to partition further within its tenant): it is
*appended* to the tenant's salt, never used instead of it, so no request can reach another tenant's
namespace. Without a tenants file the router is single-tenant: any key (or none) is accepted, salt "".

The master reads the same file (`kvpool master` setting `tenants`) for the per-tenant pool quotas,
keyed by cache salt (`Tenants.with_pool_quota`); the router ignores them.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvpool.errors import InvalidArgument


class _TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    api_keys: list[str] = Field(min_length=1)
    cache_salt: str | None = None
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


OPEN_TENANT = Tenant(name="default", cache_salt="")


def tenant_salt(cache_salt: str) -> str:
    """The tenant's part of a namespace's cache salt (a client's sub-salt follows the first "/")."""
    return cache_salt.split("/", 1)[0]


def _derived_salt(name: str) -> str:
    return hashlib.blake2b(name.encode(), digest_size=16, person=b"kvpool-tenant").hexdigest()


class Tenants:
    """Resolves API keys. `authenticate` → a `Tenant` or None (unknown key: the caller answers 401)."""

    def __init__(self, by_key: dict[str, Tenant] | None) -> None:
        self._by_key = by_key

    @classmethod
    def open(cls) -> Tenants:
        """Single tenant: every request, with any key or none, is the default tenant (salt "")."""
        return cls(None)

    @classmethod
    def load(cls, path: str | Path) -> Tenants:
        """Read a tenants file; `InvalidArgument` naming the file and the field on any error."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except OSError as exc:
            raise InvalidArgument(f"{p}: cannot read tenants file: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"{p}: {exc}") from None
        try:
            parsed = _TenantsFile.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "(top level)"
            raise InvalidArgument(f"{p}: {where}: {first['msg']}") from None
        by_key = {}
        for t in parsed.tenants:
            salt = t.cache_salt if t.cache_salt is not None else _derived_salt(t.name)
            tenant = Tenant(t.name, salt, t.pool_quota_blocks)
            by_key.update(dict.fromkeys(t.api_keys, tenant))
        salts = {t.cache_salt for t in by_key.values()}
        if len(salts) != len({t.name for t in by_key.values()}):
            raise InvalidArgument(f"{p}: tenants must have distinct cache salts")
        return cls(by_key)

    def with_pool_quota(self) -> dict[str, Tenant]:
        """Cache salt -> tenant, for the tenants that have a pool quota."""
        tenants = (self._by_key or {}).values()
        return {t.cache_salt: t for t in tenants if t.pool_quota_blocks is not None}

    @property
    def required(self) -> bool:
        """True when requests must carry a known API key."""
        return self._by_key is not None

    def authenticate(self, api_key: str | None) -> Tenant | None:
        if self._by_key is None:
            return OPEN_TENANT
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
