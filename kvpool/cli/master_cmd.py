"""`kvpool master`: run the master; prints `KVPOOL_READY {"grpc_address": ..., "metrics_address": ...}`
once serving."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import typer
from pydantic import ValidationError

from kvpool.cli.settings_help import settings_command
from kvpool.index.policies import ONLINE_POLICY_NAMES


def register_master_command(app: typer.Typer) -> None:
    # Options default to None (unset: TOML/env apply); --help shows MasterSettings' defaults.
    @app.command(cls=settings_command("kvpool.master.settings:MasterSettings", {"listen": "bind_host"}))
    def master(
        listen: str | None = typer.Option(None, help="Bind host."),
        port: int | None = typer.Option(None, help="gRPC port (0: ephemeral)."),
        layout: str | None = typer.Option(
            None, help="The pool's KV layout (the default: the embedded model's)."
        ),
        heartbeat_timeout_ms: int | None = typer.Option(None, help="A node silent this long is dead."),
        heartbeat_interval_ms: int | None = typer.Option(None, help="Interval told to nodes."),
        high_watermark: float | None = typer.Option(None, help="Per store node: evict above this fill."),
        low_watermark: float | None = typer.Option(None, help="...down to this fill."),
        replicas: int | None = typer.Option(None, help="Default replicas per block."),
        policy: str | None = typer.Option(None, help=f"Eviction policy: {', '.join(ONLINE_POLICY_NAMES)}."),
        rebuild_grace_ms: int | None = typer.Option(
            None, help="Unclaimed inventory blocks are freed after this."
        ),
        max_index_bytes: str | None = typer.Option(
            None,
            help="The index's memory limit (8GiB, 1.5GB or bytes; default: half of this host's memory): "
            "past it the master evicts leaves or refuses new blocks (RESOURCE_EXHAUSTED).",
        ),
        metrics: bool | None = typer.Option(
            None, "--metrics/--no-metrics", help="Serve Prometheus /metrics."
        ),
        metrics_port: int | None = typer.Option(None, help="/metrics port on the bind host (0: ephemeral)."),
        etcd: str | None = typer.Option(
            None, help="etcd endpoints HOST:PORT[,...]: elect one leader among masters (HA)."
        ),
        ha_lease_ttl_s: int | None = typer.Option(
            None, help="HA: etcd lease TTL in seconds (failover time)."
        ),
        ha_prefix: str | None = typer.Option(None, help="HA: etcd key prefix shared by the pool's masters."),
        advertise_address: str | None = typer.Option(
            None, help="HA: HOST:PORT other masters and clients reach this master at."
        ),
        config: Path | None = typer.Option(None, help="TOML config file."),
    ) -> None:
        """Run the master (index, placement, leases, node registry)."""
        from kvpool.config import load_config
        from kvpool.master import MasterSettings, serve
        from kvpool.rpc.process import print_ready

        try:
            settings = load_config(
                MasterSettings,
                config,
                bind_host=listen,
                port=port,
                layout=layout,
                heartbeat_timeout_ms=heartbeat_timeout_ms,
                heartbeat_interval_ms=heartbeat_interval_ms,
                high_watermark=high_watermark,
                low_watermark=low_watermark,
                replicas=replicas,
                policy=policy,
                rebuild_grace_ms=rebuild_grace_ms,
                max_index_bytes=max_index_bytes,
                metrics=metrics,
                metrics_port=metrics_port,
                etcd=etcd,
                ha_lease_ttl_s=ha_lease_ttl_s,
                ha_prefix=ha_prefix,
                advertise_address=advertise_address,
            )
            server = serve(settings)
        except ValidationError:
            raise  # a bad setting: `kvpool.cli.main` prints one line per field
        except Exception as exc:  # noqa: BLE001 - one clear line, no traceback
            typer.echo(f"kvpool master: {exc}", err=True)
            raise typer.Exit(2) from None
        ready = {"grpc_address": server.address, "metrics_address": server.metrics_address}
        print_ready(ready)
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        done.wait()
        server.stop()
        sys.stdout.flush()
