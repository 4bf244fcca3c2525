"""`kvpool admin masters`: the masters of a pool in high availability (etcd), each as it sees itself.

Any master answers `Masters`, standbys included; the one given by `--master` names the leader and the
standbys, and each of them that `--master` lists is then asked for its own role, epoch, elections won and
failovers seen (one that does not answer is listed as `unreachable`; one not in `--master` is listed, never
called: its address comes from etcd). A single master without etcd is listed alone, leading.
"""

from __future__ import annotations

from typing import Any

from kvpool.cli.admin_common import JSON, _Ctx, _run, _table, admin_app


def ha_summary(client: Any) -> dict[str, Any]:
    """The HA keys of `kvpool admin status` (empty without HA): leader, standbys, epoch, etcd endpoints."""
    m = client.masters()
    if not m.ha:
        return {}
    return {
        "leader": m.leader or "unknown",
        "standbys": ", ".join(m.standbys) or "-",
        "epoch": m.epoch,
        "etcd": ", ".join(m.etcd_endpoints),
    }


def _one(address: str) -> dict[str, Any]:
    from kvpool.client import MasterClient
    from kvpool.errors import KVPoolError

    try:
        with MasterClient(address, timeout_s=_Ctx.timeout_s) as c:
            m = c.masters()
    except KVPoolError as exc:
        return {"address": address, "role": "unreachable", "error": f"{type(exc).__name__}: {exc}"}
    return {
        "address": address,
        "role": m.role,
        "leader": m.leader,
        "epoch": m.epoch,
        "elections": m.elections,
        "failovers": m.failovers,
    }


def _not_asked(address: str) -> dict[str, Any]:
    """A master named by the election but not in `--master`: never called (nor given the token), since an
    address read from etcd may be forged."""
    return {"address": address, "role": "not asked (not in --master)"}


@admin_app.command()
def masters(as_json: bool = JSON) -> None:
    """The pool's masters: the leader and the standbys, with each one's role, epoch, elections and failovers
    as it reports them, and the etcd endpoints and lease TTL (s) of the election."""

    def fn(c: Any) -> dict[str, Any]:
        m = c.masters()
        if not m.ha:
            return {"ha": False, "masters": [{"address": c.address, "role": "leader", "epoch": 0}]}
        names = ([m.leader] if m.leader else []) + [s for s in m.standbys if s != m.leader]
        if m.address not in names:
            names.append(m.address)
        return {
            "ha": True,
            "leader": m.leader,
            "epoch": m.epoch,
            "etcd_endpoints": list(m.etcd_endpoints),
            "lease_ttl_s": m.lease_ttl_s,
            "masters": [_one(a) if a in c.addresses else _not_asked(a) for a in names],
        }

    def render(r: dict[str, Any]) -> None:
        cols = ["address", "role", "epoch", "elections", "failovers"]
        rows = [[x.get(k, "") for k in cols] for x in r["masters"]]
        title = "masters"
        if r["ha"]:
            title += f" (etcd {', '.join(r['etcd_endpoints'])}, lease TTL {r['lease_ttl_s']} s)"
        _table(title, cols, rows)

    _run(fn, as_json, render)
