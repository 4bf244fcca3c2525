"""`kvpool demo`: the main job, imported on use."""

from __future__ import annotations

from pathlib import Path

import typer

from kvpool.cli.checks import device_option, load_trace_option


def register_role_commands(app: typer.Typer) -> None:
    @app.command()
    def demo(
        json_out: Path | None = typer.Option(None, "--json", help="Write the summary JSON here."),
        trace: Path | None = typer.Option(
            None, help="Mooncake-format conversation trace (default: shared or shipped)."
        ),
        trace_block_tokens: int = typer.Option(
            64, min=1, help="Tokens per trace block (the trace's are 512)."
        ),
        conversations: int = typer.Option(4, min=1, help="Chat conversations to replay."),
        questions: int = typer.Option(3, min=1, max=5, help="Questions per RAG document (1-5)."),
        max_tokens: int = typer.Option(8, min=1, help="Tokens to generate per request."),
        device: str = typer.Option("cpu", help="torch device for the serving nodes.", callback=device_option),
        model: str | None = typer.Option(None, help="HF model directory (default: the embedded model)."),
    ) -> None:
        """Start a local cluster of real processes and serve RAG + multi-turn chat through the pool."""
        from kvpool.demo.run import run_demo
        from kvpool.demo.workload import default_chat_trace

        chat_trace = load_trace_option(trace or default_chat_trace())  # before anything starts
        summary = run_demo(
            json_out=json_out, trace=chat_trace, trace_block_tokens=trace_block_tokens, num_conversations=conversations,
            questions_per_doc=questions, max_tokens=max_tokens, device=device, model_dir=model,
        )  # fmt: skip
        if not summary["greedy_equal"]:
            raise typer.Exit(1)
