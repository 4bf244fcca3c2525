"""What a live test needs from the host, and the one way it skips without it.

Every skip for a missing capability goes through `skip(capability, why)` (or `mark(capability, why)`), so
its reason reads `needs <capability>: <why>`, e.g. `needs etcd: no etcd binary found ...`. Locally a host
without UCX or etcd skips those tests and says which capability it lacks (`pytest -rs` lists them). Where
`KVPOOL_TEST_REQUIRE` (a comma list of `CAPABILITIES`, e.g. `ucx,etcd,root`) names the capability, the root
`tests/conftest.py` turns that skip into a failure: CI sets it (`.ci/run`), so a suite it relies on cannot
go green by skipping.

Each `*_missing()` returns None when the capability is there, else why not (one line).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from typing import NoReturn

import pytest

CAPABILITIES: dict[str, str] = {
    "ucx": "UCX initialises in this process (the live data-plane, store and cluster tests)",
    "etcd": "an etcd binary (`make etcd`) for the high-availability tests",
    "root": "uid 0, e.g. to write another process's memory (the corrupt-bytes fault test)",
    "netns": "network namespaces and tc (root with iproute2): the multi-host and throttled-link tests",
    "ptrace": "ptrace rights over a child process (/proc/<pid>/mem writes)",
    "memfd": "the store's segment is a memfd mapping (/proc/<pid>/maps)",
    "kernels": "the C kernels (transfer._kernels) are built",
    "avx2": "the C kernels have their AVX2 build",
    "openssl": "the openssl command, for the TLS test's self-signed certificate",
    "ipv6": "the IPv6 loopback (::1), a second peer address on one host (the per-peer rate-limit test)",
    "loopmount": "root may loop-mount a fresh ext4 image and make it fail (the disk tier's full-disk and "
    "read-only-disk tests)",
    "nonroot": "a uid other than 0, which directory modes bind (the unwritable-directory test; as root a "
    "read-only file system stands in)",
}
"""The capability names a skip may cite and `KVPOOL_TEST_REQUIRE` may list, each with what it means."""

REQUIRE_ENV = "KVPOOL_TEST_REQUIRE"
_NEEDS = re.compile(r"\bneeds ([a-z0-9_]+): ")


class UnknownCapability(ValueError):
    """A capability name outside `CAPABILITIES` (a typo in a test or in `KVPOOL_TEST_REQUIRE`)."""


def reason(capability: str, why: str) -> str:
    """The skip reason `needs <capability>: <why>`; UnknownCapability for a name not in CAPABILITIES."""
    if capability not in CAPABILITIES:
        raise UnknownCapability(f"unknown capability {capability!r}; known: {', '.join(CAPABILITIES)}")
    return f"needs {capability}: {why}"


def skip(capability: str, why: str) -> NoReturn:
    """Skip the running test (or, at module level, the module) for lack of `capability`."""
    __tracebackhide__ = True  # the skip's location is the test's line, not this one
    pytest.skip(reason(capability, why), allow_module_level=True)


def skip_unless(capability: str, missing: str | None) -> None:
    """Skip for lack of `capability` when `missing` (a `*_missing()` result) is not None."""
    __tracebackhide__ = True
    if missing is not None:
        skip(capability, missing)


def mark(capability: str, missing: str | None) -> pytest.MarkDecorator:
    """A `skipif` marker for lack of `capability` when `missing` is not None (evaluated once, now)."""
    return pytest.mark.skipif(missing is not None, reason=reason(capability, str(missing)))


def required(value: str | None = None) -> frozenset[str]:
    """The capabilities `KVPOOL_TEST_REQUIRE` (or `value`) names; UnknownCapability for any unknown one."""
    text = os.environ.get(REQUIRE_ENV, "") if value is None else value
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    for name in sorted(names):
        reason(name, "")  # raises for an unknown name
    return names


def capability_of(skip_reason: str) -> str | None:
    """The capability a skip reason cites (`needs <capability>: ...`), None when it cites none."""
    found = _NEEDS.search(skip_reason)
    return found.group(1) if found else None


# --- the checks -----------------------------------------------------------------------------------------


def ucx_missing() -> str | None:
    import transfer

    return transfer.ucx_available()


def etcd_missing() -> str | None:
    from kvpool.cluster.etcd import NO_ETCD, etcd_binary

    return NO_ETCD if etcd_binary() is None else None


def root_missing() -> str | None:
    return None if os.geteuid() == 0 else f"running as uid {os.geteuid()}, not root"


def netns_missing() -> str | None:
    """Network namespaces joined by veth pairs: Linux, root, `ip` (iproute2) on PATH."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) not found"
    return None


def require_ucx() -> None:
    __tracebackhide__ = True
    skip_unless("ucx", ucx_missing())


def require_etcd() -> None:
    __tracebackhide__ = True
    skip_unless("etcd", etcd_missing())


def require_netns() -> None:
    __tracebackhide__ = True
    skip_unless("netns", netns_missing())
