"""`kvpool up -c cluster.toml`: start this host's processes of a cluster spec and keep them running.

Starts master → stores → prefill/decode → router (those whose host is this machine; with `[cluster]
masters > 1` an embedded etcd and that many masters, every other role given their list), waits until each
announced itself and passes its health check (gRPC health for the gRPC roles, `GET /health` for the
router), prints the endpoints (each with its Prometheus `/metrics`) and, for roles on other hosts, the
command to run there. Each role's output is echoed with a `[name]` prefix. A role that exits is
restarted after a back-off on the ports it bound the first time, with its node id (one line says so);
one that crashes more often than `[cluster] max_restarts` within `restart_window_s` stops everything
with one line naming it (exit 1). Ctrl-C or SIGTERM stops everything (children also die with this
process on Linux), freeing the ports.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import typer

from kvpool.cli.admin_common import POSITIVE


def register_up_command(app: typer.Typer) -> None:
    @app.command()
    def up(
        config: Path = typer.Option(..., "--config", "-c", help="Cluster spec (TOML)."),
        timeout_s: float = typer.Option(
            180.0, help="Seconds to wait for each role to become healthy.", callback=POSITIVE
        ),
        quiet: bool = typer.Option(False, help="Do not echo the roles' logs."),
        insecure: bool = typer.Option(
            False,
            "--insecure",
            help="No cluster secret and no join tokens: any process that reaches the master may join, "
            "read and write (local experiments only).",
        ),
    ) -> None:
        """Start a cluster from a TOML spec (local processes) and run until Ctrl-C/SIGTERM."""
        from kvpool.cluster.spec import is_local, load_spec
        from kvpool.errors import InvalidArgument

        try:
            spec = load_spec(config)
        except InvalidArgument as exc:
            typer.echo(f"kvpool up: {exc}", err=True)
            raise typer.Exit(2) from None
        if spec.cluster.masters > 1:
            from kvpool.cluster.etcd import NO_ETCD, etcd_binary

            if etcd_binary() is None:
                typer.echo(
                    f"kvpool up: {config}: cluster.masters = {spec.cluster.masters}: {NO_ETCD}", err=True
                )
                raise typer.Exit(2)
        if all(is_local(h) for h in (*spec.prefill.hosts, *spec.decode.hosts)):  # the nodes' device is here
            from kvpool.model.settings import check_device

            try:
                check_device(spec.cluster.device)
            except ValueError as exc:
                typer.echo(f"kvpool up: {config}: cluster.device: {exc}", err=True)
                raise typer.Exit(2) from None
        if spec.router.enabled and spec.router.tenants and is_local(spec.router.host):
            from kvpool.tenants import Tenants  # a file the router would refuse at every start: say so now

            try:
                Tenants.load(spec.router.tenants)
            except InvalidArgument as exc:
                typer.echo(f"kvpool up: {config}: router.tenants: {exc}", err=True)
                raise typer.Exit(2) from None
        raise typer.Exit(run_up(spec, timeout_s=timeout_s, echo=not quiet, secured=not insecure))


def _wait_http(url: str, timeout_s: float, cancel: threading.Event) -> None:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per health poll
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f}s")
        if cancel.wait(0.2):
            raise TimeoutError(f"{url}: start cancelled")


def _ready(role: object, timeout_s: float, stop: threading.Event) -> dict[str, Any]:
    """Wait for one role (stopping at once on Ctrl-C/SIGTERM, restarting it when it crashes as its policy
    allows) and say how long it took to start, so a slow or stuck start shows which role it is."""
    from kvpool.cluster.supervise import SupervisedRole

    assert isinstance(role, SupervisedRole)
    t0 = time.monotonic()
    info = role.wait_ready(timeout_s, cancel=stop)
    typer.echo(f"kvpool up: {role.name} ready in {time.monotonic() - t0:.1f} s", err=True)
    return info


def _supervise(roles: list[Any], timeout_s: float, stop: threading.Event) -> None:
    """Until `stop`: a role that exits is restarted after its back-off on the same ports (one line says
    so); `GaveUp` when one crashed more often than its policy allows."""
    from kvpool.cluster.process import NodeStartFailed

    while not stop.is_set():
        for role in roles:
            if role.crashed:
                role.schedule_restart(role.proc.proc.returncode)
            elif role.restart_at is not None and time.monotonic() >= role.restart_at:
                role.respawn()
                try:
                    _ready(role, timeout_s, stop)
                except NodeStartFailed:  # no answer within timeout_s (it was stopped), or Ctrl-C
                    if stop.is_set():
                        return
                    role.schedule_restart(role.proc.proc.returncode, how=f"no answer within {timeout_s:g} s")
        stop.wait(0.2)


def _say(line: str) -> None:
    typer.echo(f"kvpool up: {line}", err=True)


def _cluster_tls(spec: Any, log_dir: Path) -> Any:
    """gRPC TLS for every role and this process (`kvpool.cluster.tls.UpTls`): a fresh CA and certificate
    under `log_dir/tls`, the operator's `KVPOOL_TLS_*` files when set, none with `[cluster] tls = false`."""
    from kvpool.cluster.tls import UpTls, spec_hosts
    from kvpool.errors import InvalidArgument
    from kvpool.rpc.security import security

    try:
        tls = UpTls.make(log_dir, spec_hosts(spec), enabled=spec.cluster.tls, environ=os.environ)
    except InvalidArgument as exc:
        typer.echo(f"kvpool up: {exc}", err=True)
        raise typer.Exit(2) from None
    tls.apply(os.environ)  # the roles inherit it; this process's health checks use it too
    security.cache_clear()
    return tls


def _echo_logs(paths: list[Path], stop: threading.Event) -> None:
    offsets: dict[Path, int] = {}
    while not stop.is_set():
        for p in list(paths):
            try:
                with p.open() as f:
                    f.seek(offsets.get(p, 0))
                    chunk = f.read()
                    offsets[p] = f.tell()
            except OSError:
                continue
            if chunk:
                typer.echo(chunk, nl=False)
        stop.wait(0.2)


def _membership_env(log_dir: Path, secured: bool) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(the stores' and master's secret entries, the master's token-digest entries, the other roles' join
    token entries); unsecured: all empty, and the secret variables of this environment are dropped."""
    from kvpool.capability import new_secret_env
    from kvpool.master.members import UNSECURED_WARNING
    from kvpool.membership import new_cluster_tokens

    if not secured:
        for name in ("KVPOOL_CLUSTER_SECRET", "KVPOOL_CLUSTER_SECRET_FILE", "KVPOOL_JOIN_TOKENS_FILE"):
            os.environ.pop(name, None)
        typer.echo(f"kvpool up: --insecure: {UNSECURED_WARNING}", err=True)
        return {}, {}, {}
    secret_env = new_secret_env(log_dir)  # data-plane capabilities on: master and stores share it
    _token, master_env, member_env = new_cluster_tokens(log_dir)
    return secret_env, master_env, member_env


def _vllm_model_dir(spec: object, log_dir: Path) -> str:
    """The model directory vLLM engines serve: the spec's, else the embedded model exported (with a
    tokenizer vLLM loads offline) under `log_dir`."""
    from kvpool.cluster.spec import ClusterSpec
    from kvpool.model.export import export_model_dir

    assert isinstance(spec, ClusterSpec)
    return spec.cluster.model or str(export_model_dir(log_dir / "model"))


def run_up(spec: object, *, timeout_s: float, echo: bool, secured: bool = True) -> int:
    """Start and supervise; returns the exit code (0 on a clean stop, 1 when a role failed). `secured`:
    master and stores share a fresh cluster secret, every other role a fresh join token."""
    from kvpool.capability import SECRET_ROLES
    from kvpool.cluster.etcd import EtcdPlan
    from kvpool.cluster.launch import master_addresses, plan
    from kvpool.cluster.spec import ClusterSpec
    from kvpool.cluster.supervise import GaveUp, RestartPolicy, SupervisedRole, stop_roles
    from kvpool.router.model_info import ModelInfo
    from kvpool.rpc.server import wait_healthy

    assert isinstance(spec, ClusterSpec)
    layout = ModelInfo.load(spec.cluster.model or None, block_size=spec.cluster.block_size).layout
    log_dir = Path(tempfile.mkdtemp(prefix="kvpool-up-"))
    tls = _cluster_tls(spec, log_dir)
    etcd = None
    if spec.cluster.masters > 1:  # masters in HA: they elect their leader on an embedded etcd
        etcd = EtcdPlan.on(log_dir / "etcd", client_port=spec.master.etcd_port)
    launches = plan(spec, layout.fingerprint(), etcd=etcd)
    secret_env, master_env, member_env = _membership_env(log_dir, secured)
    policy = RestartPolicy.of(spec.cluster)
    procs: list[SupervisedRole] = []
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    logs: list[Path] = []
    if echo:
        threading.Thread(target=_echo_logs, args=(logs, stop), name="up-logs", daemon=True).start()
    master = ",".join(master_addresses(spec))
    masters: list[str] = []  # the addresses the local masters bound (their READY lines)
    endpoints: list[str] = []
    remote: list[str] = []
    engines: list[SupervisedRole] = []  # vLLM engines started and not yet waited for
    model_dir = spec.cluster.model
    code = 0
    try:
        for launch in launches:
            if stop.is_set():
                break
            holds_secret = launch.role in SECRET_ROLES
            if not launch.local:
                if holds_secret and secured:
                    note = f"  (KVPOOL_CLUSTER_SECRET_FILE = a 0600 copy of {log_dir / 'cluster_secret'})"
                elif secured:
                    note = f"  (KVPOOL_JOIN_TOKEN_FILE = a 0600 copy of {log_dir / 'join_token'})"
                else:
                    note = ""
                remote.append(f"  on {launch.host}: {launch.command(master, model_dir)}" + note)
                continue
            role_env = secret_env if holds_secret else member_env
            if launch.role == "master":
                role_env = role_env | master_env
            env = dict(os.environ) | role_env | launch.env
            if launch.role == "etcd":  # the masters' etcd: it serves before they start
                proc = SupervisedRole(launch.name, [], log_path=log_dir / "etcd.log", env=env, argv=launch.argv,
                                      ready_url=launch.ready_url, policy=policy, say=_say)  # fmt: skip
                procs.append(proc)
                logs.append(proc.log_path)
                _ready(proc, timeout_s, stop)
                endpoints.append(
                    f"  {launch.name:<8} {etcd.endpoint if etcd else ''}  (data: {log_dir / 'etcd'})"
                )
                continue
            if launch.argv:  # a vLLM engine: started now, waited for with the others (they load in parallel)
                if not model_dir:
                    model_dir = _vllm_model_dir(spec, log_dir)
                argv = launch.resolved(master, model_dir)
                proc = SupervisedRole(launch.name, [], log_path=log_dir / f"{launch.name}.log", env=env,
                                      argv=argv, ready_url=launch.ready_url, policy=policy, say=_say)  # fmt: skip
                procs.append(proc)
                logs.append(proc.log_path)
                engines.append(proc)
                continue
            for engine in engines:  # every engine serves before the router starts
                endpoints.append(f"  {engine.name:<8} {_ready(engine, timeout_s, stop)['url']}/v1")
            engines.clear()
            args = launch.resolved(master, model_dir)
            proc = SupervisedRole(
                launch.name, args, log_path=log_dir / f"{launch.name}.log", env=env, policy=policy, say=_say
            )
            procs.append(proc)
            logs.append(proc.log_path)
            info = _ready(proc, timeout_s, stop)
            if launch.role == "router":
                _wait_http(f"http://{info['http_address']}/health", timeout_s, stop)
                http = f"http://{info['http_address']}"
                endpoints.append(f"  router   {http}/v1  (metrics: {http}/metrics)")
            else:
                address = info.get("grpc_address", "")
                if address:
                    wait_healthy(address, timeout_s)
                if launch.role == "master":
                    masters.append(address)
                    master = ",".join(masters)
                metrics = info.get("metrics_address", "")
                endpoints.append(
                    f"  {launch.name:<8} {address}"
                    + (f"  (metrics: http://{metrics}/metrics)" if metrics else "")
                )
        for engine in engines:
            if not stop.is_set():
                endpoints.append(f"  {engine.name:<8} {_ready(engine, timeout_s, stop)['url']}/v1")
        if not stop.is_set():
            typer.echo("kvpool cluster up:\n" + "\n".join(endpoints))
            if remote:
                typer.echo("start these on their hosts:\n" + "\n".join(remote))
            if secured:
                typer.echo(
                    "secured: stores prove the cluster secret, other members present the join token; "
                    f"for the admin CLI: export KVPOOL_JOIN_TOKEN_FILE={log_dir / 'join_token'}"
                )
            else:
                typer.echo(
                    "UNSECURED (--insecure): any process that reaches the master may join, read and write"
                )
            typer.echo(
                f"gRPC TLS (mutual) for the admin CLI and roles on other hosts (copy the files): {tls.export_line()}"
                if tls.env
                else "gRPC in plaintext ([cluster] tls = false)"
            )
            typer.echo(f"logs in {log_dir}; Ctrl-C stops everything")
        _supervise(procs, timeout_s, stop)
    except GaveUp as exc:
        _say(str(exc))
        code = 1
    except (RuntimeError, TimeoutError) as exc:
        typer.echo(f"kvpool up: {exc}", err=True)
        code = 1
    finally:
        stop.set()
        stop_roles(procs, _say)
        for name in ("cluster_secret", "join_token", "join_tokens.json"):  # logs stay; credentials do not
            (log_dir / name).unlink(missing_ok=True)
        typer.echo("kvpool cluster stopped")
        tls.remove_files()  # the key this run made (never the operator's)
    return code
