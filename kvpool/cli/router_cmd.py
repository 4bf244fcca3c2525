"""`kvpool router`: the OpenAI-compatible HTTP front; prints `KVPOOL_READY {"http_address": ...}`."""

from __future__ import annotations

from pathlib import Path

import typer

from kvpool.cli.checks import engine_option
from kvpool.cli.settings_help import settings_command


def register_router_command(app: typer.Typer) -> None:
    # Options default to None (unset: TOML/env apply); --help shows RouterSettings' defaults.
    @app.command(
        cls=settings_command(
            "kvpool.router.settings:RouterSettings",
            {"listen": "bind_host", "salt_key_file": "tenant_salt_key_file"},
        )
    )
    def router(
        master: str | None = typer.Option(
            None, help="Master HOST:PORT (HOST:PORT,HOST:PORT...: masters in HA)."
        ),
        master_wait_s: float | None = typer.Option(
            None, help="Seconds to retry an unreachable master at start before exiting (default 30)."
        ),
        listen: str | None = typer.Option(None, help="Bind host."),
        port: int | None = typer.Option(None, help="HTTP port (0: ephemeral)."),
        policy: str | None = typer.Option(None, help="cost | affinity | least-load | round-robin."),
        engines: str | None = typer.Option(
            None,
            help="kvpool (kvpool's prefill/decode nodes) | vllm (vLLM engines with the connector).",
            callback=engine_option,
        ),
        model: str | None = typer.Option(None, help="Model directory (default: the embedded model)."),
        served_model_name: str | None = typer.Option(
            None, help="Model name in the API (default: the model id)."
        ),
        tenants: str | None = typer.Option(
            None, help="Tenants TOML (0600): API keys -> tenant -> cache salt (default: one tenant)."
        ),
        salt_key_file: str | None = typer.Option(
            None, help="Key of the tenants' derived salts (0600 file, >= 16 bytes; the master's too)."
        ),
        max_inflight_per_tenant: int | None = typer.Option(
            None, help="Requests in flight per tenant; more get 429 (default: half of --max-inflight)."
        ),
        max_connections: int | None = typer.Option(None, help="Open connections served; more get 503."),
        body_timeout_s: float | None = typer.Option(None, help="Seconds to receive a body (408 past it)."),
        block_size: int | None = typer.Option(None, help="Tokens per block (default: the master's)."),
        seed: int | None = typer.Option(None, help="Seed of the tie-breaking random choice."),
        max_inflight: int | None = typer.Option(None, help="Concurrent requests; more get 429."),
        max_prompt_tokens: int | None = typer.Option(None, help="Longest prompt accepted (400 above)."),
        max_request_bytes: int | None = typer.Option(None, help="Largest request body in bytes (413 above)."),
        config: Path | None = typer.Option(None, help="TOML config file."),
    ) -> None:
        """Run the router: OpenAI-compatible API, prefix-affinity vs load placement, /metrics."""
        from pydantic import ValidationError

        from kvpool.cli.errors import run_or_exit
        from kvpool.config import load_config
        from kvpool.router.serve import serve
        from kvpool.router.settings import RouterSettings

        try:
            settings = load_config(
                RouterSettings,
                config,
                master=master,
                master_wait_s=master_wait_s,
                bind_host=listen,
                port=port,
                policy=policy,
                engines=engines,
                model=model,
                served_model_name=served_model_name,
                tenants=tenants,
                tenant_salt_key_file=salt_key_file,
                max_inflight_per_tenant=max_inflight_per_tenant,
                max_connections=max_connections,
                body_timeout_s=body_timeout_s,
                block_size=block_size,
                seed=seed,
                max_inflight=max_inflight,
                max_prompt_tokens=max_prompt_tokens,
                max_request_bytes=max_request_bytes,
            )
        except ValidationError:
            raise  # a bad setting: `kvpool.cli.main` prints one line per field
        except Exception as exc:  # noqa: BLE001 - one clear line, no traceback
            typer.echo(f"kvpool router: {exc}", err=True)
            raise typer.Exit(2) from None
        run_or_exit("router", lambda: serve(settings))
