"""A local cluster of real processes on 127.0.0.1: master, store nodes, prefill and decode nodes; with
`masters > 1`, an etcd and that many masters in high availability (kvpool.master.ha).

Used by `kvpool demo`, the end-to-end tests and the benchmarks. Every process is stopped on exit, on
Ctrl-C and on SIGTERM (and dies with its parent on Linux): no orphans, ports freed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from kvpool.capability import SECRET_ROLES, Capabilities, CapabilityKey, new_secret_env
from kvpool.cluster.process import RoleProcess
from kvpool.membership import new_cluster_tokens
from kvpool.rpc.serving_key import KEY_FILE_ENV, new_serving_key

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalClusterSpec:
    """What to start. `layout` is a `KVLayout.fingerprint()`; `model_dir` None = the embedded model."""

    layout: str
    num_stores: int = 2
    num_prefill: int = 1
    num_decode: int = 1
    segment_size: str = "256MiB"
    num_replicas: int = 1  # the master's --replicas and the replicas each prefill and decode node publishes
    block_size: int = 64
    model_dir: str | None = None
    device: str = "cpu"
    host: str = "127.0.0.1"
    heartbeat_timeout_ms: int = 10_000
    extra_env: dict[str, str] = field(default_factory=dict)
    capabilities: bool = True  # master and stores share a fresh cluster secret (kvpool.capability)
    masters: int = 1  # > 1: an etcd (kvpool.cluster.etcd) and that many masters electing a leader on it


class LocalCluster:
    """Start with `with LocalCluster(spec) as cluster:`; addresses in `master_address` (with several masters:
    their comma list, as clients take it), `prefill`, …"""

    def __init__(self, spec: LocalClusterSpec, *, log_dir: Path | None = None) -> None:
        self.spec = spec
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvpool-cluster-"))
        self._secret_env = new_secret_env() if spec.capabilities else {}
        self._master_env: dict[str, str] = {}
        self._member_env: dict[str, str] = {}  # roles without the secret: the join token file
        self._saved_env: dict[str, str | None] = {}
        self.join_token = ""
        """Secured cluster: its join token (`KVPOOL_JOIN_TOKEN_FILE` of this process while it runs)."""
        self._node_env: dict[str, str] = {}  # serving nodes: the serving key's digest
        if spec.capabilities:
            self.join_token, self._master_env, self._member_env = new_cluster_tokens(self.log_dir)
            caller_env, self._node_env = new_serving_key(self.log_dir)
            self._member_env |= caller_env  # this process (and routers it starts) calls the nodes
        self.processes: list[RoleProcess] = []
        self.master_address = ""
        self.masters: list[RoleProcess] = []  # `master` is the first
        self.etcd: RoleProcess | None = None  # masters > 1: their etcd, at `etcd_endpoint`
        self.etcd_endpoint = ""
        self.stores: list[RoleProcess] = []
        self.prefill: list[RoleProcess] = []
        self.decode: list[RoleProcess] = []

    # -- lifecycle

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, args: list[str]) -> RoleProcess:
        role_env = self._secret_env if args[0] in SECRET_ROLES else self._member_env
        if args[0] == "master":
            role_env = role_env | self._master_env
        env = dict(os.environ) | self.spec.extra_env | role_env
        if args[0] in ("prefill", "decode") and self._node_env:  # the key's digest only, never the key
            env.pop(KEY_FILE_ENV, None)
            env |= self._node_env
        proc = RoleProcess(name, args, log_path=self.log_dir / f"{name}.log", env=env)
        self.processes.append(proc)
        return proc

    def _start(self, timeout_s: float) -> None:
        s = self.spec
        if self._member_env:  # this process and its children are members too (tests, benchmarks)
            self._saved_env = {k: os.environ.get(k) for k in self._member_env}
            os.environ.update(self._member_env)
        if s.masters > 1:
            self._start_etcd(timeout_s)
        self.masters = [self._start_master(0, i) for i in range(s.masters)]
        self.master = self.masters[0]
        self.master_address = ",".join(m.wait_ready(timeout_s)["grpc_address"] for m in self.masters)
        for i in range(s.num_stores):
            self.stores.append(self.start_store(f"store{i}", wait=False))
        for proc in self.stores:
            proc.wait_ready(timeout_s)
        model_args = ["--model", s.model_dir] if s.model_dir else []
        # the nodes publish `num_replicas` replicas (a node's own setting: it names the count in each Reserve)
        common = ["--master", self.master_address, "--listen", s.host, "--port", "0", "--device", s.device,
                  "--block-size", str(s.block_size), "--replicas", str(s.num_replicas), *model_args]  # fmt: skip
        for i in range(s.num_prefill):
            self.prefill.append(self._spawn(f"prefill{i}", ["prefill", "--node-id", f"prefill{i}", *common]))
        for i in range(s.num_decode):
            self.decode.append(self._spawn(f"decode{i}", ["decode", "--node-id", f"decode{i}", *common]))
        for proc in self.prefill + self.decode:
            proc.wait_ready(timeout_s)
        log.info("local cluster up: master %s, logs in %s", self.master_address, self.log_dir)

    def _start_etcd(self, timeout_s: float) -> None:
        from kvpool.cluster.etcd import EtcdPlan

        etcd = EtcdPlan.on(self.log_dir / "etcd", host="127.0.0.1")  # FailedPrecondition without a binary
        self.etcd = RoleProcess("etcd", [], log_path=self.log_dir / "etcd.log", argv=etcd.argv,
                                ready_url=etcd.health_url)  # fmt: skip
        self.processes.append(self.etcd)
        self.etcd.wait_ready(timeout_s)
        self.etcd_endpoint = etcd.endpoint

    def _start_master(self, port: int, index: int = 0) -> RoleProcess:
        s = self.spec
        return self._spawn(
            f"master{index}" if s.masters > 1 else "master",
            ["master", "--listen", s.host, "--port", str(port), "--layout", s.layout, "--replicas", str(s.num_replicas),
             "--heartbeat-timeout-ms", str(s.heartbeat_timeout_ms),
             *(["--etcd", self.etcd_endpoint] if self.etcd_endpoint else [])],
        )  # fmt: skip

    @property
    def master_addresses(self) -> list[str]:
        """Each master's address, in start order (`masters[i]`'s)."""
        return [m.info["grpc_address"] for m in self.masters]

    def restart_master(self, *, kill: bool = True, timeout_s: float = 60.0, index: int = 0) -> None:
        """kill -9 (or stop) master `index` and start a fresh one on the same address: it starts from
        nothing and rebuilds its index from the store nodes' inventories and the nodes' re-registrations
        (in high availability it joins as a standby while another master leads)."""
        old = self.masters[index]
        port = int(old.info["grpc_address"].rsplit(":", 1)[1])
        if kill:
            old.kill()
        else:
            old.stop()
        self.processes.remove(old)
        self.masters[index] = self._start_master(port, index)
        self.master = self.masters[0]
        self.masters[index].wait_ready(timeout_s)

    def start_store(self, node_id: str, *, wait: bool = True, timeout_s: float = 60.0) -> RoleProcess:
        """Start (or restart) a store node; with `wait`, block until it serves."""
        s = self.spec
        proc = self._spawn(
            node_id,
            ["store", "--master", self.master_address, "--listen", s.host, "--grpc-port", "0", "--data-port", "0",
             "--segment-size", s.segment_size, "--layout", s.layout, "--node-id", node_id],
        )  # fmt: skip
        if wait:
            proc.wait_ready(timeout_s)
        return proc

    def capabilities(self) -> Capabilities | None:
        """The cluster secret's key when this cluster generated it inline (tests sign with it), else None."""
        secret = self._secret_env.get("KVPOOL_CLUSTER_SECRET", "")
        return Capabilities(CapabilityKey(secret.encode())) if secret else None

    @property
    def member_env(self) -> dict[str, str]:
        """Environment entries a process needs to join this cluster as a non-store member ({} unsecured)."""
        return dict(self._member_env)

    def stop(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}
        for proc in reversed(self.processes):
            try:
                proc.stop()
            except Exception:  # noqa: BLE001 - keep stopping the others
                log.exception("stopping %s", proc.name)
        self.processes.clear()
        if self._own_log_dir and not log.isEnabledFor(logging.DEBUG):
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- addresses

    @property
    def prefill_addresses(self) -> list[str]:
        return [p.info["grpc_address"] for p in self.prefill]

    @property
    def decode_addresses(self) -> list[str]:
        return [p.info["grpc_address"] for p in self.decode]

    @property
    def metrics_addresses(self) -> dict[str, str]:
        """Process name -> its Prometheus `/metrics` host:port (processes that announced one)."""
        return {p.name: p.info["metrics_address"] for p in self.processes if p.info.get("metrics_address")}

    def logs(self) -> str:
        return "\n".join(p.log_tail(40) for p in self.processes)
