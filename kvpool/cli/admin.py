"""`kvpool admin --master HOST:PORT …`: operate a live pool over gRPC.

Rich tables for people, `--json` on every command, a non-zero exit on failure, and one clear line (no
stack trace) when the master is down or refuses.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import typer

from kvpool.console import console

admin_app = typer.Typer(no_args_is_help=True, help="Operate a live pool (status, nodes, stats, versions...).")


def _checked(ok: Callable[[float], bool], expected: str) -> Callable[[Any], Any]:
    """An option callback: a value outside `ok` (NaN and ±inf never pass) is a usage error (exit 2, naming
    the option and what it expects) before any call to the master, not a refusal by the master (exit 1)."""

    def callback(value: Any) -> Any:
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise typer.BadParameter(f"must be {expected}, got {value}")
        return value

    return callback


POSITIVE = _checked(lambda v: v > 0, "> 0")
NON_NEGATIVE = _checked(lambda v: v >= 0, ">= 0")
UNIT_FRACTION = _checked(lambda v: 0 < v <= 1, "in (0, 1]")


def _non_empty(value: str) -> str:
    if not value.strip():
        raise typer.BadParameter("must not be empty")
    return value


def _namespace_hex(value: str) -> str:
    """A `--namespace` digest given as hex, checked before any call ("" only where it may be left out)."""
    from kvpool.hashing import parse_hash

    if value:
        try:
            parse_hash(value, "namespace")
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def _namespace_hex_given(value: str) -> str:
    if not value:
        raise typer.BadParameter("must be 32 hex characters, got ''")
    return _namespace_hex(value)


def _known_gpu(gpu: str) -> str:
    from kvpool.bench.economics import GPUS

    if gpu not in GPUS:
        raise typer.BadParameter(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    return gpu


class _Ctx:
    master: str = "127.0.0.1:50051"
    timeout_s: float = 5.0


@admin_app.callback()
def _admin(
    master: str = typer.Option("127.0.0.1:50051", "--master", help="Master HOST:PORT."),
    timeout_s: float = typer.Option(5.0, "--timeout", help="Deadline per call (s), > 0.", callback=POSITIVE),
) -> None:
    from kvpool.config import check_host_port

    try:
        check_host_port(master)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--master") from None
    _Ctx.master, _Ctx.timeout_s = master, timeout_s


def _run(fn: Callable[[Any], Any], as_json: bool, render: Callable[[Any], None]) -> None:
    """Call `fn(client)`; print JSON or a table; one line and exit 1 on any kvpool error."""
    from kvpool.client import MasterClient
    from kvpool.errors import KVPoolError

    try:
        with MasterClient(_Ctx.master, timeout_s=_Ctx.timeout_s) as client:
            result = fn(client)
    except KVPoolError as exc:
        typer.echo(f"kvpool admin: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    except ValueError as exc:
        typer.echo(f"kvpool admin: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(_plain(result), indent=2, sort_keys=True))
    else:
        render(result)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.table import Table

    table = Table(title=title)  # not expanded: as wide as its cells (see kvpool.console)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*[str(x) for x in r])
    console().print(table)


def _kv(title: str, data: dict[str, Any]) -> None:
    _table(title, ["key", "value"], [[k, v] for k, v in data.items()])


JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")


@admin_app.command()
def status(as_json: bool = JSON) -> None:
    """Pool summary: nodes and stores alive (of registered), blocks, fill, hit rate.

    `used_bytes`, `capacity_bytes` and `fill` are over the live stores only (the master's Stats), as is
    `stores_alive`; `nodes` and `stores` also count the dead (heartbeat expired or deregistered) ones."""

    def fn(c: Any) -> dict[str, Any]:
        s = c.stats()
        stores = [n for n in s.nodes if n.node.role == "store"]
        return {
            "master": _Ctx.master,
            "nodes_alive": sum(1 for n in s.nodes if n.alive),
            "nodes": len(s.nodes),
            "stores_alive": sum(1 for n in stores if n.alive),
            "stores": len(stores),
            "num_blocks": s.num_blocks,
            "used_bytes": s.used_bytes,
            "capacity_bytes": s.capacity_bytes,
            "fill": round(s.used_bytes / s.capacity_bytes, 4) if s.capacity_bytes else 0.0,
            "hit_rate": round(s.hit_rate, 4),
            "num_live_leases": s.num_live_leases,
            "uptime_s": round(s.uptime_s, 1),
        }

    _run(fn, as_json, lambda r: _kv("kvpool status", r))


@admin_app.command()
def nodes(as_json: bool = JSON) -> None:
    """Registered nodes with liveness, fill and blocks."""
    cols = ["node", "role", "alive", "draining", "grpc", "data", "used/slots", "blocks", "queue"]

    def render(ns: Any) -> None:
        rows = [
            [
                n.node.node_id,
                n.node.role,
                n.alive,
                n.draining,
                n.node.grpc_address,
                n.node.data_address,
                f"{n.num_used_slots}/{n.num_slots}",
                n.num_blocks,
                n.load.queue_len,
            ]
            for n in ns
        ]
        _table("nodes", cols, rows)

    _run(lambda c: c.list_nodes(), as_json, render)


@admin_app.command()
def namespaces(as_json: bool = JSON) -> None:
    """Registered namespaces: the digest (for `invalidate`/`match --namespace`), model, version, blocks."""

    def render(ns: Any) -> None:
        rows = [[x.namespace.hex(), x.model_id, x.weights_version, x.active, x.num_blocks] for x in ns]
        _table("namespaces", ["namespace", "model", "version", "active", "blocks"], rows)

    _run(lambda c: c.stats().namespaces, as_json, render)


@admin_app.command()
def stats(as_json: bool = JSON) -> None:
    """All pool counters (hit tokens and requested tokens, evictions, leases...)."""

    def render(s: Any) -> None:
        data = {k: v for k, v in _plain(s).items() if k not in ("nodes", "namespaces")}
        data["hit_rate"] = round(s.hit_rate, 4)
        _kv("kvpool stats", data)

    _run(lambda c: c.stats(), as_json, render)


MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as uint32 (kvpool.hashing.encode_tokens)


def parse_token_ids(text: str, param_hint: str = "'TOKENS'") -> list[int]:
    """Token ids from `1,2,3` (spaces and empty items ignored); `typer.BadParameter` naming the argument and
    what it expects otherwise (exit 2, no traceback)."""
    items = [t for t in text.replace(" ", "").split(",") if t]
    bad = [t for t in items if not (t.isascii() and t.isdigit()) or int(t) > MAX_TOKEN_ID]  # no sign, no 1.5
    if bad or not items:
        got = f"{bad[0]!r} in {text!r}" if bad else repr(text)
        raise typer.BadParameter(
            f"expected comma-separated integer token ids in 0-{MAX_TOKEN_ID} (e.g. 1,2,3), got {got}",
            param_hint=param_hint,
        )
    return [int(t) for t in items]


@admin_app.command()
def match(
    tokens: str = typer.Argument(..., help="Comma-separated token ids, e.g. 1,2,3 (each in 0-4294967295)."),
    namespace: str = typer.Option("", help="Namespace digest (32 hex chars).", callback=_namespace_hex),
    model: str = typer.Option("", help="Model id (with --version) instead of --namespace."),
    version: str = typer.Option("", help="Weights version."),
    layout: str = typer.Option(
        "", help="KV layout fingerprint (with --model; default: the embedded model's)."
    ),
    salt: str = typer.Option("", help="Cache salt (with --model)."),
    as_json: bool = JSON,
) -> None:
    """Peek how many leading blocks of a token sequence are in the pool (no counters, no lease, nothing
    registered: the namespace of --model/--version is computed here, as every node computes it)."""
    from kvpool.hashing import Namespace, hash_blocks, parse_hash
    from kvpool.types import DEFAULT_LAYOUT, KVLayout

    ids = parse_token_ids(tokens)  # before any call: a typo is a usage error (exit 2), not a master error
    if namespace and (model or version):
        raise typer.BadParameter("give --namespace or --model/--version, not both", param_hint="--namespace")
    if not namespace and not (model and version):
        raise typer.BadParameter("give --namespace, or --model and --version", param_hint="--model")
    try:
        lay = KVLayout.from_fingerprint(layout or DEFAULT_LAYOUT)
        ns = (
            parse_hash(namespace, "namespace")
            if namespace
            else Namespace(model_id=model, weights_version=version, layout=lay, cache_salt=salt).digest()
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    def fn(c: Any) -> dict[str, Any]:
        block_size = lay.block_size if layout or not namespace else c.stats().block_size
        hashes = hash_blocks(ns, ids, block_size)
        m = c.match(ns, hashes)
        return {
            "namespace": ns.hex(),
            "num_blocks": len(hashes),
            "num_matched": m.num_matched,
            "matched_tokens": m.num_matched * block_size,
            "replicas": [
                [f"{x.node_id}:{x.slot}" + (" (local)" if x.local else "") for x in r] for r in m.replicas
            ],
        }

    _run(fn, as_json, lambda r: _kv("match", r))


@admin_app.command("set-version")
def set_version(
    model: str = typer.Option(..., "--model", help="Model id.", callback=_non_empty),
    version: str = typer.Option(..., "--version", help="Weights version to activate.", callback=_non_empty),
    as_json: bool = JSON,
) -> None:
    """Activate a weights version: every other version of the model becomes unreachable."""

    def fn(c: Any) -> dict[str, Any]:
        previous, n = c.set_model_version(model, version)
        return {"model": model, "previous_version": previous, "version": version, "namespaces_invalidated": n}

    _run(fn, as_json, lambda r: _kv("set-version", r))


@admin_app.command()
def invalidate(
    namespace: str = typer.Option(
        ..., "--namespace", help="Namespace digest (32 hex chars).", callback=_namespace_hex_given
    ),
    as_json: bool = JSON,
) -> None:
    """Flush one namespace: its blocks are unreachable now (reclaimed in the background), publishes begun
    before are refused, serving nodes drop their local tiers at their next heartbeat; an active namespace
    then fills again from new publishes."""
    from kvpool.hashing import parse_hash

    def fn(c: Any) -> dict[str, Any]:
        c.invalidate(parse_hash(namespace, "namespace"))
        return {"namespace": namespace.lower(), "invalidated": True}

    _run(fn, as_json, lambda r: _kv("invalidate", r))


@admin_app.command()
def evict(
    fraction: float = typer.Option(
        ..., "--fraction", help="Fraction of resident blocks, in (0, 1].", callback=UNIT_FRACTION
    ),
    node: str = typer.Option("", "--node", help="Only this store node's slots."),
    as_json: bool = JSON,
) -> None:
    """Evict a fraction of the unleased leaf blocks by the eviction policy."""

    def fn(c: Any) -> dict[str, Any]:
        n, short = c.evict(fraction, node)
        return {"fraction": fraction, "node": node, "num_evicted": n, "shortfall": short}

    _run(fn, as_json, lambda r: _kv("evict", r))


@admin_app.command()
def drain(node: str = typer.Argument(..., help="Store node id."), as_json: bool = JSON) -> None:
    """Stop placing on a node; its blocks are copied elsewhere, then its slots freed."""
    _run(
        lambda c: {"node": node, "num_blocks_to_move": c.drain(node)},
        as_json,
        lambda r: _kv("drain", r),
    )


@admin_app.command()
def economics(
    model_params: float = typer.Option(
        ..., "--model-params", help="Model parameters, e.g. 8e9.", callback=POSITIVE
    ),
    window_s: float = typer.Option(
        2.0, "--window", help="Measure counters over this many seconds.", callback=POSITIVE
    ),
    num_layers: int = typer.Option(
        32, "--layers", help="Transformer layers (attention term).", callback=NON_NEGATIVE
    ),
    d_attn: int = typer.Option(
        4096, "--d-attn", help="Attention width n_heads x head_dim (attention term).", callback=NON_NEGATIVE
    ),
    gpu: str = typer.Option(
        "H100-SXM",
        help="GPU for 'GPUs saved' (H100-SXM, H200-SXM, A100-SXM, L40S, MI300X).",
        callback=_known_gpu,
    ),
    mfu: float = typer.Option(
        0.5, help="Model FLOP utilisation assumed for prefill on that GPU, in (0, 1].", callback=UNIT_FRACTION
    ),
    as_json: bool = JSON,
) -> None:
    """Saved prefill tokens/s (λ x mean reused tokens per request), FLOP/s and GPUs saved, from live counters.

    Formulas and sources: `kvpool.bench.economics` (saved tokens/s = λ·h·s_c; FLOP = 2Ψ per token plus
    causal attention 4·layers·d_attn per pair; GPUs = FLOP/s ÷ (peak·MFU); Mooncake FAST'25, SGLang).
    """
    import time

    from kvpool.bench import economics as eco

    shape = eco.ModelShape(name="given", params=model_params, num_layers=num_layers, d_attn=d_attn)

    def fn(c: Any) -> dict[str, Any]:
        a = c.stats()
        time.sleep(window_s)
        b = c.stats()
        w = eco.workload_from_counters(a, b, window_s)
        hit_tps = (b.hit_tokens - a.hit_tokens) / window_s
        req_tps = (b.requested_tokens - a.requested_tokens) / window_s
        flop = eco.saved_flop_per_s(w, shape)
        total = w.request_rate_per_s * shape.prefill_flop(w.mean_prompt_tokens)
        gpus = eco.gpus_saved(flop, eco.GPUS[gpu], mfu)
        traffic = eco.has_traffic(w)
        return {
            "window_s": window_s,
            "request_rate_per_s": round(w.request_rate_per_s, 3),
            "mean_reused_tokens_per_request": round(w.mean_reused_tokens, 1),
            "saved_prefill_tokens_per_s": round(w.saved_tokens_per_s, 2),
            "hit_tokens_per_s": round(hit_tps, 2),
            "requested_tokens_per_s": round(req_tps, 2),
            "hit_rate_window": round(hit_tps / req_tps, 4) if traffic else None,
            "flop_per_s_saved": flop,
            "share_prefill_flop_saved": round(flop / total, 4) if traffic else None,
            f"gpus_saved_{gpu}": round(gpus, 4),
            "mfu": mfu,
            "hit_tokens_total": b.hit_tokens,
            "flop_saved_total": 2.0 * model_params * b.hit_tokens,
            "verdict": eco.verdict(flop / total, gpus, gpu) if traffic else eco.no_traffic(window_s),
        }

    _run(fn, as_json, lambda r: _kv("economics", {k: "-" if v is None else v for k, v in r.items()}))
