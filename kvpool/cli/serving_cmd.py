"""`kvpool prefill` and `kvpool decode`: run a serving node (imports torch only when started)."""

from __future__ import annotations

from pathlib import Path

import typer


def register_serving_commands(app: typer.Typer) -> None:
    for role in ("prefill", "decode"):
        _register(app, role)
    app.command(name="layout")(layout)


def layout(
    model: str = typer.Option(None, help="HF model directory (default: the embedded synthetic model)."),
    block_size: int = typer.Option(64, min=1, help="Tokens per KV block, as the serving nodes will use."),
) -> None:
    """Print the KV layout fingerprint a serving node of this model registers with: give it to the master
    and the stores (`--layout`) before starting nodes. Reads the model directory; loads no model."""
    from kvpool.errors import KVPoolError
    from kvpool.router.model_info import ModelInfo

    try:
        typer.echo(ModelInfo.load(model, block_size=block_size).layout.fingerprint())
    except KVPoolError as exc:
        typer.echo(f"kvpool layout: {exc}", err=True)
        raise typer.Exit(1) from None


def _register(app: typer.Typer, role: str) -> None:
    def command(
        master: str = typer.Option(None, help="master host:port (host:port,host:port...: masters in HA)"),
        master_wait_s: float = typer.Option(
            None, help="seconds to retry an unreachable master at start before exiting (default 30)"
        ),
        listen: str = typer.Option(None, help="address to bind (default 127.0.0.1)"),
        port: int = typer.Option(None, help="gRPC port (0 = ephemeral)"),
        node_id: str = typer.Option(
            None, help="node id, unique per node (default: role-host-port; role-host-pPID with --port 0)"
        ),
        model: str = typer.Option(None, help="HF model directory (default: the embedded synthetic model)"),
        device: str = typer.Option(None, help="torch device: cpu, cuda, cuda:1 ..."),
        block_size: int = typer.Option(None, help="tokens per KV block"),
        local_tier_bytes: int = typer.Option(None, help="node-local tier capacity in bytes (0 = off)"),
        replicas: int = typer.Option(None, help="replicas per published block"),
        metrics: bool = typer.Option(None, "--metrics/--no-metrics", help="serve Prometheus /metrics"),
        metrics_port: int = typer.Option(None, help="/metrics port on the bind host (0 = ephemeral)"),
        config: Path = typer.Option(None, help="TOML config file"),
    ) -> None:
        from kvpool.cli.errors import run_or_exit
        from kvpool.config import load_config
        from kvpool.serving.common import ServingSettings

        settings = load_config(
            ServingSettings,
            config,
            master=master,
            master_wait_s=master_wait_s,
            bind_host=listen,
            port=port,
            node_id=node_id,
            model=model,
            device=device,
            block_size=block_size,
            local_tier_bytes=local_tier_bytes,
            num_replicas=replicas,
            metrics=metrics,
            metrics_port=metrics_port,
        )
        if role == "prefill":
            from prefill_node.main import main
        else:
            from decode_node.main import main
        run_or_exit(role, lambda: main(settings))

    command.__doc__ = f"Run a {role} node."
    app.command(name=role)(command)
