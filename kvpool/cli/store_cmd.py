"""`kvpool store`: run a store node (imports grpc/ucxx only when the command runs)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvpool.cli.settings_help import settings_command


def register_store_command(app: typer.Typer) -> None:
    # Options default to None (unset: TOML/env apply); --help shows StoreSettings' defaults.
    @app.command(cls=settings_command("kvpool.store.settings:StoreSettings", {"listen": "bind_host"}))
    def store(
        master: str | None = typer.Option(None, help="Master HOST:PORT (omit: standalone)."),
        listen: str | None = typer.Option(None, help="Bind/advertise host."),
        grpc_port: int | None = typer.Option(None, help="gRPC control port (0: ephemeral)."),
        data_port: int | None = typer.Option(None, help="UCX data port (0: ephemeral)."),
        segment_size: str | None = typer.Option(None, help="Segment size, e.g. 256MiB, 4GiB."),
        layout: str | None = typer.Option(
            None, help="KV layout fingerprint (the default: the embedded model's)."
        ),
        node_id: str | None = typer.Option(None, help="Node id (default store-<host>-<pid>)."),
        pin_memory: str | None = typer.Option(None, help="auto | on | off (pinned host memory)."),
        share_segment: bool | None = typer.Option(
            None,
            "--share-segment/--no-share-segment",
            help="Let same-host readers copy blocks from a read-only mapping of the segment (a pinned segment "
            "is never shared).",
        ),
        metrics: bool | None = typer.Option(
            None, "--metrics/--no-metrics", help="Serve Prometheus /metrics."
        ),
        metrics_port: int | None = typer.Option(None, help="/metrics port on the bind host (0: ephemeral)."),
        disk_path: str | None = typer.Option(
            None,
            help="Directory of the store's disk tier (must exist, writable; locked against a second store). "
            "Off when unset.",
        ),
        disk_size: str | None = typer.Option(None, help="Disk tier size with --disk-path, e.g. 64GiB."),
        metadata_only: bool | None = typer.Option(
            None,
            "--metadata-only/--no-metadata-only",
            help="For benchmarks only (kvpool bench master): commit reserved slots that no write landed in "
            "and refuse every read and write of block bytes; slots, commits and inventory are real.",
        ),
        disk_buffer_size: str | None = typer.Option(
            None, help="Bounce buffers of disk reads and writes in flight (default 256MiB; more are refused)."
        ),
        disk_move_queue_blocks: int | None = typer.Option(
            None,
            help="Tier moves (DemoteBlocks, PromoteBlocks) queued at most (default 8192; more are refused).",
        ),
        config: Path | None = typer.Option(None, help="TOML config file."),
    ) -> None:
        """Run a store node; prints `KVPOOL_READY {json}` on stdout when serving.

        With --master: once the master accepted it or could not be reached (a refusal exits 2 first).
        SIGTERM/SIGINT stop it."""
        import contextlib
        import signal
        import sys

        from pydantic import ValidationError

        from kvpool.config import load_config
        from kvpool.rpc.process import print_ready
        from kvpool.store.node import StoreNode
        from kvpool.store.settings import StoreSettings

        node = None
        try:
            settings = load_config(
                StoreSettings,
                config,
                master=master,
                bind_host=listen,
                grpc_port=grpc_port,
                data_port=data_port,
                segment_size=segment_size,
                layout=layout,
                node_id=node_id,
                pin_memory=pin_memory,
                share_segment=share_segment,
                metrics=metrics,
                metrics_port=metrics_port,
                disk_path=disk_path,
                disk_size=disk_size,
                metadata_only=metadata_only,
                disk_buffer_size=disk_buffer_size,
                disk_move_queue_blocks=disk_move_queue_blocks,
            )
            node = StoreNode(settings)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: node.request_stop())
            node.start()
        except ValidationError:
            raise  # a bad setting: `kvpool.cli.main` prints one line per field
        except Exception as exc:  # noqa: BLE001 - one clear line, no traceback (as `kvpool master`)
            typer.echo(f"kvpool store: {type(exc).__name__}: {exc}", err=True)
            if node is not None:
                with contextlib.suppress(Exception):
                    node.stop()  # whatever had started
            raise typer.Exit(2) from None
        print_ready(node.ready_info())
        try:
            node.wait()
        finally:
            node.stop()
        if node.fatal:
            print(f"store node stopped: {node.fatal}", file=sys.stderr)
            raise typer.Exit(2)
