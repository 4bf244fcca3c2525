"""The one config loader: defaults < TOML file < `KVPOOL_*` environment < CLI overrides.

Every role defines its settings as a subclass of `KVPoolSettings` (in its own package) and loads them
with `load_config(Cls, path, **cli_overrides)`. Built on pydantic-settings; validation errors name the
field. Every server binds `DEFAULT_BIND_HOST` (127.0.0.1) unless told otherwise.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_BIND_HOST = "127.0.0.1"
"""Loopback by default: a server is reachable from other hosts only when told (`--listen`)."""


def check_host_port(value: str) -> str:
    """`value` if it is `HOST:PORT` with a port in 1-65535 (IPv6 hosts in brackets); else `ValueError`."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port in 1-65535, got {value!r}")
    return value


def check_masters(value: str) -> str:
    """`value` if it is one master `HOST:PORT` or a list of masters in high availability
    (`HOST:PORT,HOST:PORT,...`, kvpool.master.ha), each checked by `check_host_port`; else `ValueError`
    naming the bad entry. The result has no blanks around the commas."""
    parts = [part.strip() for part in value.split(",")]
    for part in parts:
        if not part:
            raise ValueError(f"expected HOST:PORT[,HOST:PORT...], got an empty entry in {value!r}")
        check_host_port(part)
    return ",".join(parts)


_TOML_FILE: ContextVar[Path | None] = ContextVar("kvpool_toml_file", default=None)

S = TypeVar("S", bound="KVPoolSettings")


class KVPoolSettings(BaseSettings):
    """Base of every role's settings. Env vars are `KVPOOL_<FIELD>` (upper case)."""

    model_config = SettingsConfigDict(env_prefix="KVPOOL_", extra="forbid", frozen=True)

    bind_host: str = DEFAULT_BIND_HOST

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = _TOML_FILE.get()
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)


def load_config(cls: type[S], path: str | Path | None = None, **cli_overrides: Any) -> S:
    """Build `cls` from defaults < TOML `path` < env < `cli_overrides` (None values are ignored).

    Raises `FileNotFoundError` for a missing file and `pydantic.ValidationError` naming the field.
    """
    toml_path = None
    if path is not None:
        toml_path = Path(path)
        if not toml_path.is_file():
            raise FileNotFoundError(f"config file not found: {toml_path}")
    token = _TOML_FILE.set(toml_path)
    try:
        return cls(**{k: v for k, v in cli_overrides.items() if v is not None})
    finally:
        _TOML_FILE.reset(token)
