"""`kvpool bench …`: each benchmark lives in `kvpool.bench.<name>` and is imported on use.

Progress bars (tqdm) and plots (matplotlib) come with the `bench` extra (`kvpool.cli.bench_extra`); a
command that needs a missing one says so before it starts. The benchmarks of the pool's own parts are
defined in `kvpool.cli.bench_pool` and registered here."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from kvpool.cli.bench_extra import need_bench_extra
from kvpool.cli.bench_failover import failover_cmd
from kvpool.cli.bench_pool import index_cmd, master_churn_cmd, master_cmd, tiers_cmd, transfer_cmd
from kvpool.cli.checks import device_option

bench_app = typer.Typer(no_args_is_help=True)


@bench_app.command("ttft")
def ttft(
    prefix_tokens: int = typer.Option(8192, min=1, help="shared prefix length (tokens)"),
    question_tokens: int = typer.Option(50, min=1, help="question length (tokens)"),
    requests: int = typer.Option(3, min=1, help="warm and cold requests each"),
    block_size: int = typer.Option(64, min=1, help="tokens per block"),
    transport: str = typer.Option("tcp", help="tcp (forces UCX_TLS=tcp, the cross-host path) or auto"),
    device: str = typer.Option("cpu", help="torch device of the serving nodes", callback=device_option),
    model: str = typer.Option(None, help="HF model directory (default: embedded)"),
    json_out: Path = typer.Option(None, "--json", help="write the report JSON here"),
    sweep: bool = typer.Option(False, help="sweep prefix x question length and fit the TTFT formula"),
    prefixes: str = typer.Option("", help="--sweep: prefix lengths, comma-separated (default 256,1024,4096)"),
    questions: str = typer.Option("", help="--sweep: question lengths, comma-separated (default 16,128,512)"),
    quick: bool = typer.Option(False, help="--sweep: a tiny grid (smoke test)"),
    plot: Path = typer.Option(None, "--plot", help="--sweep: write a PNG of the fit here"),
    routing_table: Path = typer.Option(
        None,
        "--routing-table",
        help="Record the routing simulation's service-time table here instead (cold, pulled and local "
        "TTFT over prompt length x reused fraction; --requests repetitions, --quick a tiny grid)",
    ),
) -> None:
    """Cold vs warm TTFT for RAG with a long shared prefix pulled from the pool (`--sweep`: a grid + fit)."""
    from kvpool.bench.ttft import TRANSPORTS

    if routing_table is not None:
        from kvpool.bench import routing_record as rr
        from kvpool.errors import InvalidArgument

        try:
            rr.record_service_times(
                routing_table,
                prompts=rr.QUICK_PROMPTS if quick else rr.FULL_PROMPTS,
                fractions=rr.QUICK_FRACTIONS if quick else rr.FULL_FRACTIONS,
                reps=requests,
                model_dir=model,
            )
        except InvalidArgument as exc:
            raise typer.BadParameter(str(exc)) from None
        return

    if transport not in TRANSPORTS:
        raise typer.BadParameter(
            f"must be {' or '.join(TRANSPORTS)}, got {transport!r}", param_hint="'--transport'"
        )
    if sweep:
        from kvpool.bench import ttft_sweep

        try:
            plist = [int(x) for x in prefixes.split(",") if x.strip()] or None
            qlist = [int(x) for x in questions.split(",") if x.strip()] or None
        except ValueError:
            raise typer.BadParameter("--prefixes / --questions take comma-separated integers") from None
        if min([*(plist or [1]), *(qlist or [1])]) < 1:
            raise typer.BadParameter("--prefixes / --questions take lengths >= 1")
        grid_p = plist or (ttft_sweep.QUICK_PREFIXES if quick else ttft_sweep.FULL_PREFIXES)
        grid_q = qlist or (ttft_sweep.QUICK_QUESTIONS if quick else ttft_sweep.FULL_QUESTIONS)
        _prompt_fits(max(grid_p) + max(grid_q), model, "'--prefixes' + '--questions'")
        need_bench_extra("ttft --sweep", plot=plot)
        ttft_sweep.run_ttft_sweep(
            prefixes=plist,
            questions=qlist,
            reps=requests,
            quick=quick,
            block_size=block_size,
            model_dir=model,
            json_out=json_out,
            plot_out=plot,
        )
        return
    from kvpool.bench.ttft import run_ttft

    _prompt_fits(prefix_tokens + question_tokens, model, "'--prefix-tokens' + '--question-tokens'")
    run_ttft(
        prefix_tokens=prefix_tokens,
        question_tokens=question_tokens,
        num_requests=requests,
        block_size=block_size,
        transport=transport,
        device=device,
        model_dir=model,
        json_out=json_out,
    )


def _prompt_fits(prompt_tokens: int, model: str | None, param_hint: str) -> None:
    """A usage error (exit 2) before anything starts when the nodes would refuse a prompt this long."""
    from kvpool.bench.ttft import check_prompt_fits
    from kvpool.errors import InvalidArgument

    try:
        check_prompt_fits(prompt_tokens, model)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc), param_hint=param_hint) from None


@bench_app.command("burst")
def burst_cmd(
    burst: int = typer.Option(50, min=1, help="requests fired at once on one prefix (each arm)"),
    prefix_tokens: int = typer.Option(256, min=1, help="shared prefix length (tokens)"),
    question_tokens: int = typer.Option(16, min=1, help="tokens after the prefix, distinct per request"),
    block_size: int = typer.Option(64, min=1, help="tokens per block"),
    warmup_bursts: int = typer.Option(
        1,
        min=0,
        help="unmeasured pull bursts first, from which the node learns its link's contended throughput",
    ),
    rounds: int = typer.Option(3, min=1, help="interleaved rounds of the two measured bursts"),
    model: str = typer.Option(None, help="HF model directory (default: embedded)"),
    json_out: Path = typer.Option(None, "--json", help="write the report JSON here"),
) -> None:
    """Pull convoys (B39): a burst on one cached prefix pulled (cost model sees the queue) vs recomputed."""
    from kvpool.bench.burst import run_burst

    _prompt_fits(prefix_tokens + question_tokens, model, "'--prefix-tokens' + '--question-tokens'")
    if prefix_tokens < block_size:  # no full block to cache: the pull arm would have nothing to pull
        raise typer.BadParameter(
            f"{prefix_tokens} tokens hold no full block of {block_size}: the pull arm would have nothing to pull",
            param_hint="'--prefix-tokens'",
        )
    run_burst(
        burst=burst,
        prefix_tokens=prefix_tokens,
        question_tokens=question_tokens,
        block_size=block_size,
        warmup_bursts=warmup_bursts,
        rounds=rounds,
        model_dir=model,
        json_out=json_out,
    )


@bench_app.command("vllm")
def vllm_cmd(
    num_prefixes: int = typer.Option(5, min=1, help="distinct RAG prefixes (the medians are over them)"),
    prefix_tokens: int = typer.Option(8192, min=1, help="tokens per RAG prefix"),
    question_tokens: int = typer.Option(50, min=1, help="tokens per question"),
    max_tokens: int = typer.Option(16, min=1, help="greedy tokens generated per request"),
    python: str = typer.Option(sys.executable, help="python of a venv with vllm (runs the engines)"),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG: per-prefix TTFT (a)/(b)/(c)."),
    log_dir: Path | None = typer.Option(None, help="Keep the engines' and the pool's logs here."),
) -> None:
    """vLLM TTFT with kvpool's connector: (a) cold, (b) vLLM's own prefix cache, (c) loaded from the pool."""
    need_bench_extra("vllm", plot=plot)
    from kvpool.bench.vllm_bench import run_vllm_bench
    from kvpool.errors import InvalidArgument

    try:
        run_vllm_bench(
            num_prefixes=num_prefixes,
            prefix_tokens=prefix_tokens,
            question_tokens=question_tokens,
            max_tokens=max_tokens,
            python=python,
            json_out=json_out,
            plot_out=plot,
            log_dir=log_dir,
        )
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from None


@bench_app.command("crossover")
def crossover_cmd(
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG: TTFT pulled vs recomputed per link."),
    quick: bool = typer.Option(False, help="Tiny grid (one model, 2 prefixes, 2 throttles): a smoke test."),
    reps: int = typer.Option(3, help="Measurements per cell and mode (the median is scored)."),
    rates: str = typer.Option(
        "auto", help="Throttle rates in Mb/s, comma-separated, or auto (around break-even)."
    ),
    question_tokens: int = typer.Option(32, help="Tokens after the shared prefix."),
    netns: bool = typer.Option(True, help="Measure tc-throttled links between network namespaces (root)."),
    fresh_calibration: bool | None = typer.Option(
        None, help="Re-calibrate recompute at start (default: yes, except --quick)."
    ),
) -> None:
    """Transfer vs recompute: real TTFT pulled vs recomputed per model, link and prefix; cost model's choice."""
    from kvpool.bench.crossover import run_crossover

    try:
        rate_list = None if rates.strip() == "auto" else [float(x) for x in rates.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--rates: {rates!r} is not 'auto' or a list of numbers") from None
    if reps < 1:
        raise typer.BadParameter("--reps must be >= 1")
    need_bench_extra("crossover", plot=plot)
    run_crossover(
        quick=quick,
        reps=reps,
        rates_mbit=rate_list,
        question_tokens=question_tokens,
        netns=netns,
        fresh_calibration=fresh_calibration,
        json_out=json_out,
        plot_out=plot,
    )


@bench_app.command("economics")
def economics_cmd(
    trace: Path | None = typer.Option(
        None, "--trace", help="Mooncake-format JSONL (default: bundled conversation trace)."
    ),
    master: str | None = typer.Option(
        None, "--master", help="Use this master's live counters instead of a trace."
    ),
    window_s: float = typer.Option(5.0, "--window", help="Live counters: seconds between the two reads."),
    model: str = typer.Option("llama-3-8b", help="Model shape: llama-3-8b, llama-3-70b, qwen2.5-7b."),
    gpus: str = typer.Option("H100-SXM,A100-SXM", help="GPUs for 'GPUs saved' (comma-separated)."),
    mfu: float = typer.Option(0.5, help="Assumed prefill MFU on those GPUs."),
    capacity_frac: float | None = typer.Option(
        None, help="Trace: pool capacity as a fraction of unique blocks."
    ),
    measure_local: bool = typer.Option(
        False, help="Also divide by this machine's measured prefill tokens/s."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """Saved prefill tokens/s (λ·h·s_c), FLOP/s and GPUs saved over hit rates, with a verdict."""
    from kvpool.bench.economics import run_economics
    from kvpool.errors import InvalidArgument

    try:
        run_economics(
            trace=trace,
            master=master,
            window_s=window_s,
            model_name=model,
            gpu_names=[g.strip() for g in gpus.split(",") if g.strip()],
            mfu=mfu,
            capacity_frac=capacity_frac,
            measure_local=measure_local,
            json_out=json_out,
        )
    except (InvalidArgument, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None


@bench_app.command("trace")
def trace_cmd(
    trace: list[Path] = typer.Option(..., "--trace", help="Mooncake-format JSONL trace (repeatable)."),
    capacity_frac: str = typer.Option(
        "0.02,0.05,0.1,0.2,0.4", help="Capacities, fractions of unique blocks."
    ),
    policies: str = typer.Option(
        "lru,lfu,fwlru,cost,opt,default",
        help="Comma-separated policies ('default': the pool's; with lru, the target is graded).",
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of hit rate vs capacity."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Replay traces through the radix index: token prefix-hit rate per policy and capacity."""
    need_bench_extra("trace", progress=True, plot=plot)
    from kvpool.bench.trace import parse_fractions, parse_policies, run_trace_bench
    from kvpool.errors import InvalidArgument

    try:
        run_trace_bench(
            trace, parse_fractions(capacity_frac), parse_policies(policies), json_out, plot, progress=progress
        )
    except (InvalidArgument, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None


bench_app.command("index")(index_cmd)
bench_app.command("tiers")(tiers_cmd)
bench_app.command("master")(master_cmd)
bench_app.command("failover")(failover_cmd)
bench_app.command("master-churn")(master_churn_cmd)
bench_app.command("transfer")(transfer_cmd)


@bench_app.command("routing")
def routing_cmd(
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG: p90 TTFT per policy per node count."),
    quick: bool = typer.Option(
        False, help="Bundled 400-request trace, 4 and 8 nodes, no real run: a smoke test."
    ),
    nodes: str = typer.Option("", help="Simulated prefill node counts, comma-separated (default 4,8,16)."),
    seed: int = typer.Option(0, help="Seed of the router's tie-breaking and the service-time noise."),
    trace: Path | None = typer.Option(None, "--trace", help="Mooncake-format JSONL (default: conversation)."),
    load: float = typer.Option(0.9, help="Offered cold prefill work per node (1 = saturated without cache)."),
    profile: str = typer.Option(
        "embedded-cpu",
        help="Node calibration: embedded-cpu, or llama3-8b-h100 with a --service-times table recorded on that hardware.",
    ),
    max_requests: int = typer.Option(0, help="Replay only the first N requests (0: all)."),
    real: bool | None = typer.Option(
        None, "--real/--no-real", help="Also a live 2-prefill run (default: on, off with --quick)."
    ),
    real_requests: int = typer.Option(40, help="Requests per policy and round in the live run."),
    real_batch: int = typer.Option(
        10, help="Live run: requests per batch (the policies take turns per batch)."
    ),
    real_rounds: int = typer.Option(
        3, help="Live run: rounds (each policy replays its requests, cold, per round)."
    ),
    service_times: Path | None = typer.Option(
        None,
        "--service-times",
        help="Measured service-time table (default: the shipped one; record with `kvpool bench ttft --routing-table`).",
    ),
) -> None:
    """Routing policies: simulated p50/p90 TTFT, hit rate and imbalance over 4-16 nodes, plus a live check."""
    from kvpool.bench.routing import run_routing
    from kvpool.errors import InvalidArgument

    try:
        node_list = [int(x) for x in nodes.split(",") if x.strip()] or ([4, 8] if quick else [4, 8, 16])
    except ValueError:
        raise typer.BadParameter(f"--nodes: {nodes!r} is not a list of integers") from None
    need_bench_extra("routing", progress=True, plot=plot)
    try:
        run_routing(
            trace_path=trace,
            nodes=node_list,
            profile=profile,
            load=load,
            seed=seed,
            quick=quick,
            real=(not quick) if real is None else real,
            real_requests=real_requests,
            real_batch=real_batch,
            real_rounds=real_rounds,
            service_times=service_times,
            max_requests=max_requests or None,
            json_out=json_out,
            plot_out=plot,
        )
    except (InvalidArgument, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None


@bench_app.command("vllm-replay")
def vllm_replay_cmd(
    trace: Path | None = typer.Option(None, "--trace", help="Mooncake-format JSONL (default: conversation)."),
    max_requests: int = typer.Option(300, min=1, help="At most this many requests (whole sessions)."),
    max_prompt_tokens: int = typer.Option(8192, min=1, help="Prompts are cut to this many tokens."),
    max_tokens: int = typer.Option(16, min=1, help="Greedy tokens generated per request."),
    speedup: float = typer.Option(20.0, min=0.001, help="Trace inter-arrival times are divided by this."),
    seed: int = typer.Option(2026, help="Seed of the session subset and of the block tokens."),
    kv_cache_gib: float = typer.Option(1.0, help="Each engine's KV cache and the pool's segment (GiB)."),
    setups: str = typer.Option(
        "two_engines_no_pool,two_engines_pool,one_engine", help="Setups to run, comma-separated."
    ),
    python: str = typer.Option("", help="Python of a venv with vllm (default: .venv-vllm/bin/python)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG: hit rate and TTFT per setup."),
    log_dir: Path | None = typer.Option(None, help="Keep the engines' and the pool's logs here."),
) -> None:
    """Mooncake conversation trace on vLLM: 2 engines without and with kvpool vs 1 engine (hit rate, TTFT)."""
    need_bench_extra("vllm-replay", plot=plot)
    from kvpool.bench.vllm_replay import run_vllm_replay
    from kvpool.errors import InvalidArgument

    try:
        run_vllm_replay(
            trace=trace,
            max_requests=max_requests,
            max_prompt_tokens=max_prompt_tokens,
            max_tokens=max_tokens,
            speedup=speedup,
            seed=seed,
            kv_cache_gib=kv_cache_gib,
            setups=tuple(s.strip() for s in setups.split(",") if s.strip()),
            python=python,
            json_out=json_out,
            plot_out=plot,
            log_dir=log_dir,
        )
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from None
