"""`kvpool router`: the OpenAI-compatible HTTP front; prints `KVPOOL_READY {"http_address": ...}`."""

from __future__ import annotations

from pathlib import Path

import typer


def register_router_command(app: typer.Typer) -> None:
    @app.command()
    def router(
        master: str | None = typer.Option(None, help="Master HOST:PORT [default: 127.0.0.1:50051]."),
        listen: str | None = typer.Option(None, help="Bind host (default 127.0.0.1)."),
        port: int | None = typer.Option(None, help="HTTP port (default 8000; 0: ephemeral)."),
        policy: str | None = typer.Option(None, help="cost (default) | affinity | least-load | round-robin."),
        engines: str | None = typer.Option(
            None,
            help="kvpool (default: kvpool's prefill/decode nodes) | vllm (vLLM engines with the connector).",
        ),
        model: str | None = typer.Option(None, help="Model directory (default: the embedded model)."),
        served_model_name: str | None = typer.Option(None, help="Model name in the API (default: model id)."),
        tenants: str | None = typer.Option(None, help="Tenants TOML: API keys -> tenant -> cache salt."),
        block_size: int | None = typer.Option(None, help="Tokens per block (default: the master's)."),
        seed: int | None = typer.Option(None, help="Seed of the tie-breaking random choice."),
        max_inflight: int | None = typer.Option(None, help="Concurrent requests; more get 429."),
        max_prompt_tokens: int | None = typer.Option(None, help="Longest prompt accepted (400 above)."),
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
                bind_host=listen,
                port=port,
                policy=policy,
                engines=engines,
                model=model,
                served_model_name=served_model_name,
                tenants=tenants,
                block_size=block_size,
                seed=seed,
                max_inflight=max_inflight,
                max_prompt_tokens=max_prompt_tokens,
            )
        except ValidationError:
            raise  # a bad setting: `kvpool.cli.main` prints one line per field
        except Exception as exc:  # noqa: BLE001 - one clear line, no traceback
            typer.echo(f"kvpool router: {exc}", err=True)
            raise typer.Exit(2) from None
        run_or_exit("router", lambda: serve(settings))
