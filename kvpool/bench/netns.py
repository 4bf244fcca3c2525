"""Network namespaces with a throttled veth pair, for the crossover benchmark (Linux, root only).

`ThrottledPair` creates two namespaces (`<prefix>-a`, `<prefix>-b`) joined by one veth pair, with private
10.x addresses that exist only inside them; nothing is routed out and the root namespace is untouched.
`set_rate(bits_per_s)` puts a `tc tbf` (token bucket; this kernel has no netem) on BOTH veth ends, so
pulls (b → a) and publishes (a → b) see the same link. `close()` deletes both namespaces (and with them
the veth pair); use it as a context manager so a failure still cleans up.

`NamespaceGroup(n)` creates `n` namespaces (`<prefix>-0` …) that act as `n` hosts on one private subnet:
each joined by a veth pair to a bridge in a hub namespace (`<prefix>-hub`); `close()` deletes them all.

`python_in_netns(name)`: role processes started inside the block (through `RoleProcess`) run in `name`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType

MIN_BURST_BYTES = 64 * 1024
"""veth hands tbf GSO super-packets up to 64 KiB; a smaller bucket would drop them."""


def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (None when they can): not root, or `ip`/`tc` missing."""
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need CAP_NET_ADMIN; throttled links skipped"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found; throttled links skipped"
    return None


def tbf_args(bits_per_s: float, *, latency_ms: float = 100.0) -> list[str]:
    """`tc qdisc` arguments of a token bucket at `bits_per_s`: bucket = max(64 KiB, 10 ms of traffic)."""
    if not bits_per_s > 0:
        raise ValueError(f"rate must be > 0, got {bits_per_s!r}")
    rate_bytes = bits_per_s / 8.0
    burst = max(MIN_BURST_BYTES, int(rate_bytes * 0.010))
    return ["tbf", "rate", f"{int(bits_per_s)}bit", "burst", str(burst), "latency", f"{latency_ms:g}ms"]


def _run(*cmd: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")


@dataclass(frozen=True, slots=True)
class PairAddresses:
    """`a` and `b` are the veth ends' addresses (no prefix length) in namespaces `ns_a`, `ns_b`."""

    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str
    a: str
    b: str


class ThrottledPair:
    """Two namespaces and a veth pair between them (see the module docstring). Root only."""

    def __init__(self, prefix: str | None = None, *, subnet: int | None = None) -> None:
        tag = prefix or f"kvpb{os.getpid() % 100000}"
        octet = subnet if subnet is not None else 100 + os.getpid() % 150
        self.addr = PairAddresses(
            ns_a=f"{tag}-a",
            ns_b=f"{tag}-b",
            dev_a=f"{tag}a"[:15],
            dev_b=f"{tag}b"[:15],
            a=f"10.231.{octet}.1",
            b=f"10.231.{octet}.2",
        )
        self.rate_bits_per_s: float | None = None
        self._created: list[str] = []

    @classmethod
    def existing(cls, addr: PairAddresses) -> ThrottledPair:
        """A handle on a pair another process created (can set rates; `close` leaves it alone)."""
        pair = cls()
        pair.addr = addr
        return pair

    def open(self) -> ThrottledPair:
        a = self.addr
        try:
            for ns in (a.ns_a, a.ns_b):
                _run("ip", "netns", "add", ns)
                self._created.append(ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run(
                "ip",
                "link",
                "add",
                a.dev_a,
                "netns",
                a.ns_a,
                "type",
                "veth",
                "peer",
                a.dev_b,
                "netns",
                a.ns_b,
            )
            for ns, dev, ip in ((a.ns_a, a.dev_a, a.a), (a.ns_b, a.dev_b, a.b)):
                _run("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise
        return self

    def set_rate(self, bits_per_s: float | None) -> None:
        """Throttle both directions to `bits_per_s` (None: remove the throttle)."""
        a = self.addr
        for ns, dev in ((a.ns_a, a.dev_a), (a.ns_b, a.dev_b)):
            if bits_per_s is None:
                with contextlib.suppress(RuntimeError):  # no qdisc yet
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root")
            else:
                _run(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    *tbf_args(bits_per_s),
                )
        self.rate_bits_per_s = bits_per_s

    def close(self) -> None:
        """Delete the namespaces created (the veth pair goes with them). Idempotent."""
        while self._created:
            ns = self._created.pop()
            with contextlib.suppress(RuntimeError):
                _run("ip", "netns", "del", ns)

    def __enter__(self) -> ThrottledPair:
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class NamespaceGroup:
    """`n` namespaces on one /24 (`addresses[i]` in `names[i]`), bridged in a hub namespace. Root only.

    Names and device names carry `prefix` (default: pid-derived), so parallel runs never collide; the
    addresses exist only inside the namespaces (each run has its own bridge), the root namespace is untouched.
    """

    def __init__(self, n: int, prefix: str | None = None, *, subnet: int | None = None) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"need 1 <= n <= 200 namespaces, got {n}")
        self.tag = prefix or f"kvg{os.getpid() % 100000}"
        octet = subnet if subnet is not None else 20 + os.getpid() % 200
        self.hub = f"{self.tag}-hub"
        self.names = [f"{self.tag}-{i}" for i in range(n)]
        self.addresses = [f"10.232.{octet}.{i + 1}" for i in range(n)]
        self._bridge = f"{self.tag}br"[:15]
        self._created: list[str] = []

    def open(self) -> NamespaceGroup:
        try:
            for ns in (self.hub, *self.names):
                _run("ip", "netns", "add", ns)
                self._created.append(ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", self.hub, "link", "add", self._bridge, "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", self._bridge, "up")
            for i, (ns, ip) in enumerate(zip(self.names, self.addresses, strict=True)):
                hub_dev, dev = f"{self.tag}h{i}"[:15], f"{self.tag}n{i}"[:15]
                _run(
                    "ip", "link", "add", hub_dev, "netns", self.hub, "type", "veth", "peer", dev, "netns", ns
                )
                _run("ip", "-n", self.hub, "link", "set", hub_dev, "master", self._bridge)
                _run("ip", "-n", self.hub, "link", "set", hub_dev, "up")
                _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise
        return self

    def exec_args(self, i: int) -> list[str]:
        """The command prefix that runs a program in namespace `i`."""
        return ["ip", "netns", "exec", self.names[i]]

    def set_link(self, i: int, up: bool) -> None:
        """Cut (`up=False`) or restore namespace `i`'s link to the bridge: a node cut off the network."""
        _run("ip", "-n", self.hub, "link", "set", f"{self.tag}h{i}"[:15], "up" if up else "down")

    def close(self) -> None:
        """Delete every namespace created (the veth pairs and the bridge go with them). Idempotent."""
        while self._created:
            ns = self._created.pop()
            with contextlib.suppress(RuntimeError):
                _run("ip", "netns", "del", ns)

    def __enter__(self) -> NamespaceGroup:
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@contextlib.contextmanager
def python_in_netns(name: str, workdir: str) -> Iterator[None]:
    """Within the block, `sys.executable` is a wrapper that runs Python through `ip netns exec <name>`, so a
    role started by `RoleProcess` (which runs `sys.executable -m kvpool.cli.main …`) lives in namespace
    `name`, with that namespace's /sys (UCX lists network devices there: a bare setns would not do).
    The wrapper (written to `workdir`, which must outlive the children's start) execs, so the child keeps
    its pid and its parent-death signal."""
    import sys

    real = sys.executable
    wrapper = os.path.join(workdir, f"python-in-{name}")
    with open(wrapper, "w") as fh:
        fh.write(f'#!/bin/sh\nexec ip netns exec {name} {real} "$@"\n')
    os.chmod(wrapper, 0o755)
    sys.executable = wrapper
    try:
        yield
    finally:
        sys.executable = real
