"""The launch plan of a cluster spec: every role process `kvpool up` starts, in start order.

`plan()` turns a `ClusterSpec` into the role commands (`kvpool master|store|prefill|decode|router …`, and
with `masters > 1` an etcd first, then the masters with `--etcd`): `kvpool up` starts those whose host is
this machine and prints the others' command lines for their hosts, every one given the list of masters.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from kvpool.cluster.etcd import EtcdPlan
from kvpool.cluster.spec import ClusterSpec, RoleSection, is_local


@dataclass(frozen=True, slots=True)
class Launch:
    """One role process: `kvpool <args>` on `host`, or `argv` (a vLLM engine) ready when `ready_url`
    answers 200. `{master}` in args and argv is the master's address (masters in HA: their comma list),
    `{model}` the model directory."""

    name: str
    role: str
    host: str
    args: list[str] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    ready_url: str = ""

    @property
    def local(self) -> bool:
        return is_local(self.host)

    def resolved(self, master: str, model: str) -> list[str]:
        """The args (or argv) with `{master}` and `{model}` filled in."""
        return [a.replace("{master}", master).replace("{model}", model) for a in (self.argv or self.args)]

    def command(self, master: str, model: str = "MODEL_DIR") -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        words = " ".join(shlex.quote(a) for a in self.resolved(master, model))
        return (f"{env} " if env else "") + ("" if self.argv else "kvpool ") + words


def master_addresses(spec: ClusterSpec) -> list[str]:
    """The masters' configured addresses ("host:port", master i on port + i; "host:0" when ephemeral)."""
    m = spec.master
    return [f"{m.host}:{m.port + i if m.port else 0}" for i in range(spec.cluster.masters)]


def plan(spec: ClusterSpec, layout: str, *, etcd: EtcdPlan | None = None) -> list[Launch]:
    """Every process of the cluster, in start order (etcd, masters, stores, serving nodes, router).
    `cluster.masters > 1` needs `etcd` (the embedded etcd the masters elect their leader on); `{master}`
    in the other roles' args then stands for the masters' comma list."""
    m, c = spec.master, spec.cluster
    out: list[Launch] = []
    elect: list[str] = []  # the masters' --etcd
    if c.masters > 1:
        if etcd is None:
            raise ValueError("cluster.masters > 1 needs an etcd (EtcdPlan)")
        out.append(Launch("etcd", "etcd", etcd.host, argv=etcd.argv, ready_url=etcd.health_url))
        elect = ["--etcd", etcd.endpoint]
    for i in range(c.masters):
        out.append(Launch(
            f"master{i}" if c.masters > 1 else "master",
            "master",
            m.host,
            [
                "master", "--listen", m.host, "--port", str(m.port + i if m.port else 0), "--layout", layout,
                "--replicas", str(m.replicas), "--policy", m.eviction_policy,
                "--high-watermark", str(m.high_watermark), "--low-watermark", str(m.low_watermark),
                "--heartbeat-timeout-ms", str(m.heartbeat_timeout_ms),
                *(["--max-index-bytes", str(int(m.max_index_bytes))] if m.max_index_bytes else []),
                *(["--metrics-port", str(m.metrics_port + i)] if m.metrics_port else []),
                *elect,
            ],
        ))  # fmt: skip

    def port(section: RoleSection, i: int) -> str:
        return str(section.port + i) if section.port else "0"

    def metrics(section: RoleSection, i: int) -> list[str]:
        return ["--metrics-port", str(section.metrics_port + i)] if section.metrics_port else []

    for i in range(spec.store.count):
        host = spec.store.hosts[i % len(spec.store.hosts)]
        out.append(Launch(f"store{i}", "store", host, [
            "store", "--master", "{master}", "--listen", host, "--grpc-port", port(spec.store, i),
            "--data-port", "0", "--segment-size", spec.store.segment_size, "--layout", layout,
            "--node-id", f"store{i}", *metrics(spec.store, i),
        ]))  # fmt: skip
    model = ["--model", c.model] if c.model else []
    for role, section in (("prefill", spec.prefill), ("decode", spec.decode)):
        for i in range(section.count):
            host = section.hosts[i % len(section.hosts)]
            if section.engine == "vllm":
                from kvpool.cluster.vllm_roles import vllm_launch  # it builds on this module's types

                out.append(vllm_launch(role, i, host, section, block_size=c.block_size, layout=layout))
                continue
            out.append(Launch(f"{role}{i}", role, host, [
                role, "--master", "{master}", "--listen", host, "--port", port(section, i), "--node-id",
                f"{role}{i}", "--device", c.device, "--block-size", str(c.block_size),
                "--replicas", str(m.replicas), *model, *metrics(section, i),
            ]))  # fmt: skip
    r = spec.router
    if r.enabled:
        tenants = ["--tenants", r.tenants] if r.tenants else []
        engines = (  # vLLM engines tokenize and register their namespaces: no model or block size here
            ["--engines", "vllm"]
            if spec.prefill.engine == "vllm"
            else ["--block-size", str(c.block_size), *model]
        )
        args = f"router --master {{master}} --listen {r.host} --port {r.port} --policy {r.policy}".split()
        out.append(Launch("router", "router", r.host, [*args, *engines, *tenants]))
    return out
