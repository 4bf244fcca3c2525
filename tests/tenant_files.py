"""Tenants files for tests: written 0600 (a file readable by others is refused), and a salt key."""

from __future__ import annotations

import os
from pathlib import Path

SALT_KEY = b"test-salt-key-0123456789abcdef"
"""A salt key for `Tenants.load(path, SALT_KEY)` (at least 16 bytes)."""


def write_private(path: Path, text: str) -> Path:
    """`text` into `path` with mode 0600; returns `path`."""
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


def salt_key_file(directory: Path, key: bytes = SALT_KEY) -> Path:
    """A 0600 salt key file holding `key` under `directory`."""
    return write_private(directory / "tenant_salt_key", key.decode())
