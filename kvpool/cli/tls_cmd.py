"""`kvpool tls DIR`: a CA and a cluster certificate for gRPC TLS across hosts (`kvpool.cluster.tls`).

`kvpool up` makes its own per run; a cluster across hosts needs one set that every host trusts: make it
once, copy DIR to every host (the key stays 0600), and export the printed line there before `kvpool up` or
a role started by hand.
"""

from __future__ import annotations

from pathlib import Path

import typer


def register_tls_command(app: typer.Typer) -> None:
    @app.command()
    def tls(
        directory: Path = typer.Argument(..., help="New directory for ca.pem, cert.pem and key.pem (0600)."),
        config: Path | None = typer.Option(
            None, "--config", "-c", help="Cluster spec (TOML): its hosts go in the certificate."
        ),
        host: list[str] = typer.Option([], "--host", help="Another host name or address to cover (repeat)."),
        days: int = typer.Option(365, min=1, max=3650, help="Days the certificates are valid."),
    ) -> None:
        """Make a CA and a certificate (server and client) covering loopback, this host, the spec's hosts and
        --host; print the `export KVPOOL_TLS_...` line that turns mutual TLS on."""
        from kvpool.cluster.spec import load_spec
        from kvpool.cluster.tls import check_host, spec_hosts, tls_env, write_cluster_tls
        from kvpool.errors import InvalidArgument

        hosts = list(host)
        try:
            if config is not None:
                hosts = spec_hosts(load_spec(config)) + hosts
            hosts = [check_host(h) for h in hosts]
        except InvalidArgument as exc:
            typer.echo(f"kvpool tls: {exc}", err=True)
            raise typer.Exit(2) from None
        if directory.exists() and any(directory.iterdir()):
            typer.echo(f"kvpool tls: {directory} is not empty (a CA is never overwritten)", err=True)
            raise typer.Exit(2)
        paths = write_cluster_tls(directory.resolve(), hosts, days=days)
        typer.echo("export " + " ".join(f"{k}={v}" for k, v in tls_env(paths).items()))
