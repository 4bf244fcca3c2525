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
import shutil
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
                Tenants.load(spec.router.tenants, salt_key=b"check-only-" * 2)  # `up` generates the key
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


def _credentials(log_dir: Path, secured: bool, launches: list[Any]) -> Any:
    """Each role's credentials (`kvpool.cluster.credentials.UpCredentials`: a join token of its own for
    every serving node and engine of `launches`); unsecured: none, and the secret variables of this
    environment are dropped."""
    from kvpool.cluster.credentials import SECRET_ENV, UpCredentials
    from kvpool.master.members import UNSECURED_WARNING

    if not secured:
        for name in (*SECRET_ENV, "KVPOOL_JOIN_TOKENS_FILE"):
            os.environ.pop(name, None)
        typer.echo(f"kvpool up: --insecure: {UNSECURED_WARNING}", err=True)
        return UpCredentials()
    return UpCredentials.make(log_dir, os.environ, launches)


def _tenant_salt_env(log_dir: Path) -> dict[str, str]:
    """The router's and master's salt key of tenants' derived salts (`kvpool.tenants`): the one this
    environment names, else a fresh 0600 file in `log_dir`. Only those two roles get it (the variable is
    scrubbed from the others' environments)."""
    from kvpool.tenants import SALT_KEY_ENV, new_salt_key_file

    if os.environ.get(SALT_KEY_ENV):
        return {SALT_KEY_ENV: os.environ[SALT_KEY_ENV]}
    return {SALT_KEY_ENV: str(new_salt_key_file(log_dir))}


def _etcd_tls(plan: Any, log_dir: Path) -> tuple[Any, Any]:
    """A secured cluster's etcd serves its clients over TLS with client certificates (a fresh CA in
    `log_dir/etcd-tls`, made as the gRPC one: `kvpool.cluster.tls.write_etcd_tls`) and answers its readiness
    check on a plain /health port: (the plan so changed, its `EtcdTls`) (docs/ha.md)."""
    import dataclasses

    from kvpool.cluster.etcd import free_port
    from kvpool.cluster.tls import write_etcd_tls

    tls = write_etcd_tls(log_dir / "etcd-tls", plan.host)
    return dataclasses.replace(plan, tls=tls.server, health_port=free_port(plan.host)), tls


def _etcd_auth(endpoint: str, log_dir: Path, tls: Any) -> dict[str, str]:
    """A secured cluster's etcd takes writes from its masters only: auth on, a root user and the `kvpool`
    user (the election's keys only), their passwords in 0600 files in `log_dir`; returns the masters' entries
    naming the user and its password file, and with `tls` (an `EtcdTls`) the CA and client certificate
    (docs/ha.md)."""
    from kvpool.cluster.etcd import enable_etcd_auth

    return enable_etcd_auth(endpoint, log_dir, tls=tls)


def _vllm_model_dir(spec: object, log_dir: Path) -> str:
    """The model directory vLLM engines serve: the spec's, else the embedded model exported (with a
    tokenizer vLLM loads offline) under `log_dir`."""
    from kvpool.cluster.spec import ClusterSpec
    from kvpool.model.export import export_model_dir

    assert isinstance(spec, ClusterSpec)
    return spec.cluster.model or str(export_model_dir(log_dir / "model"))


def run_up(spec: object, *, timeout_s: float, echo: bool, secured: bool = True) -> int:
    """Start and supervise; returns the exit code (0 on a clean stop, 1 when a role failed). `secured`:
    master and stores share a fresh cluster secret (or the operator's), every other role a fresh join token
    of its own role (`kvpool.cluster.credentials`)."""
    from kvpool.cluster.credentials import scrubbed
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
    etcd = etcd_tls = None
    etcd_env: dict[str, str] = {}  # the masters' etcd credentials (a secured cluster's etcd: TLS and auth)
    if spec.cluster.masters > 1:  # masters in HA: they elect their leader on an embedded etcd
        etcd = EtcdPlan.on(log_dir / "etcd", client_port=spec.master.etcd_port)
        if secured:
            etcd, etcd_tls = _etcd_tls(etcd, log_dir)
    launches = plan(spec, layout.fingerprint(), etcd=etcd)
    creds = _credentials(log_dir, secured, launches)
    salt_env = _tenant_salt_env(log_dir)
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
            if not launch.local:
                note = creds.remote_note(launch, salt_env)
                remote.append(f"  on {launch.host}: {launch.command(master, model_dir)}" + note)
                continue
            # the operator's environment less every credential, then this role's own (least privilege)
            role_env = creds.env_for(launch) | (salt_env if launch.role in ("master", "router") else {})
            if launch.role == "master":
                role_env = role_env | etcd_env
            env = scrubbed(os.environ) | role_env | launch.env
            if launch.role == "etcd":  # the masters' etcd: it serves before they start
                proc = SupervisedRole(launch.name, [], log_path=log_dir / "etcd.log", env=env, argv=launch.argv,
                                      ready_url=launch.ready_url, policy=policy, say=_say)  # fmt: skip
                procs.append(proc)
                logs.append(proc.log_path)
                _ready(proc, timeout_s, stop)
                if secured and etcd is not None:
                    etcd_env = _etcd_auth(etcd.endpoint, log_dir, etcd_tls)
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
            typer.echo(f"admin CLI: kvpool admin --master {master} status")
            if secured:
                admin = " ".join(f"{k}={v}" for k, v in creds.admin_env().items())
                typer.echo(
                    "secured: stores prove the cluster secret, other members present a join token of their "
                    f"role; for the admin CLI: export {admin}"
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
        creds.remove_files()  # logs stay; credentials do not
        for name in ("tenant_salt_key", "etcd_password", "etcd_root_password"):
            (log_dir / name).unlink(missing_ok=True)
        shutil.rmtree(log_dir / "etcd-tls", ignore_errors=True)
        typer.echo("kvpool cluster stopped")
        tls.remove_files()  # the key this run made (never the operator's)
    return code
