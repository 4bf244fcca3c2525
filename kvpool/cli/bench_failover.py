"""`kvpool bench failover`: kill -9 the leading master under steady serving traffic, or a soak with no kill
(`kvpool.bench.failover`)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvpool.cli.bench_extra import need_bench_extra


def failover_cmd(
    masters: int = typer.Option(3, min=2, max=7, help="masters on the one etcd"),
    lease_ttl_s: int = typer.Option(5, "--lease-ttl-s", min=1, max=60, help="the masters' etcd lease (s)"),
    warmup_s: float = typer.Option(10.0, "--warmup-s", min=1.0, help="traffic before the kill (s)"),
    after_s: float = typer.Option(15.0, "--after-s", min=1.0, help="traffic after the kill (s)"),
    soak: float = typer.Option(0.0, "--soak", min=0.0, help="S > 0: S seconds of traffic and no kill"),
    rate: float = typer.Option(8.0, min=0.5, max=200.0, help="requests per second (one closed loop)"),
    prefixes: int = typer.Option(4, min=1, help="distinct shared prefixes"),
    questions: int = typer.Option(4, min=1, help="distinct questions per prefix"),
    prefix_tokens: int = typer.Option(256, min=1, help="shared prefix length (tokens)"),
    question_tokens: int = typer.Option(16, min=1, help="question length (tokens)"),
    block_size: int = typer.Option(64, min=1, help="tokens per block"),
    max_tokens: int = typer.Option(
        8, min=1, help="greedy tokens per request, each compared with the cold reference's"
    ),
    json_out: Path = typer.Option(None, "--json", help="write the report JSON here"),
    png: Path = typer.Option(None, "--png", "--plot", help="write a PNG of hit rate and TTFT over time here"),
) -> None:
    """Kill -9 the leading master under steady load: failed requests, wrong tokens, failover and hits-back
    time beside their targets (`--soak S`: no kill, spurious failovers)."""
    from kvpool.bench.failover import run_failover
    from kvpool.bench.ttft import check_prompt_fits
    from kvpool.errors import FailedPrecondition, InvalidArgument

    try:
        check_prompt_fits(prefix_tokens + question_tokens, None)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc), param_hint="'--prefix-tokens' + '--question-tokens'") from None
    need_bench_extra("failover", plot=png)
    try:
        run_failover(
            masters=masters,
            lease_ttl_s=lease_ttl_s,
            warmup_s=warmup_s,
            after_s=after_s,
            soak_s=soak,
            rate=rate,
            prefixes=prefixes,
            questions=questions,
            prefix_tokens=prefix_tokens,
            question_tokens=question_tokens,
            block_size=block_size,
            max_tokens=max_tokens,
            json_out=json_out,
            png_out=png,
        )
    except (RuntimeError, FailedPrecondition) as exc:  # the pool did not start (no etcd binary, no leader)
        typer.echo(f"kvpool bench failover: {exc}", err=True)
        raise typer.Exit(1) from None
