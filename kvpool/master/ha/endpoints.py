"""etcd endpoint lists (no etcd client needed: settings validate them without `aetcd`)."""

from __future__ import annotations


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """Parse `HOST:PORT[,HOST:PORT...]` (each may start with `http://`) into ((host, port), ...).

    Raises ValueError naming the malformed endpoint."""
    out = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://")
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint must be HOST:PORT, got {part!r}")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoint")
    return tuple(out)
