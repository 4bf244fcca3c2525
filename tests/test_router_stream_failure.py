"""The kvpool router when the decode node of a stream in flight dies: the client gets one SSE error event
and the stream ends (no hang, no `[DONE]`), and the next request goes to a live decode node.

In-process (the router's HTTP app over fake node stubs, as in tests/test_router_failover.py): the link
drops after a chosen number of tokens. The same fault with real processes (kill -9 of the decode node
under `kvpool up`) is in tests/test_up_supervised.py (slow).
"""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from kvpool.router.http import build_app
from kvpool.router.tenants import Tenants
from tests.test_router_failover import _metric, _Node, _service


def _events(body: str) -> list[str]:
    return [x[len("data: ") :] for x in body.split("\n\n") if x.startswith("data: ")]


def test_a_decode_node_dying_mid_stream_sends_one_error_event_and_the_next_request_avoids_it() -> None:
    stubs = {"p0": _Node(), "d0": _Node(die_after=2), "d1": _Node(die_after=2)}
    svc = _service(stubs)
    http = TestClient(build_app(svc, Tenants.open()))
    body = {"model": svc.model.model_id, "prompt": "hi", "max_tokens": 8, "stream": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200  # the stream had started: the failure is an event in it
    events = _events(r.text)
    assert "[DONE]" not in events
    errors = [json.loads(e)["error"] for e in events if '"error"' in e]
    assert len(errors) == 1 and '"error"' in events[-1], events
    victim = next(name for name in ("d0", "d1") if stubs[name].calls == 1)
    assert errors[0]["message"] == f"decode on {victim}: Socket closed", errors
    assert len(events) == 1 + 2 + 1  # the first token, the two decode tokens that went out, the error
    live = "d1" if victim == "d0" else "d0"
    stubs[victim].dead = True  # still down
    stubs[live].die_after = None
    for _ in range(3):  # the failed node is in back-off: the next requests go to the live one at once
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and _events(r.text)[-1] == "[DONE]", r.text
    assert stubs[victim].calls == 1 and stubs[live].calls == 3
    text = http.get("/metrics").text
    assert _metric(text, "kvpool_router_node_failures_total", role="decode", node=victim) == 1
    assert _metric(text, "kvpool_router_requests_total", endpoint="completions", code="503") == 1
    assert _metric(text, "kvpool_router_requests_total", endpoint="completions", code="200") == 3
