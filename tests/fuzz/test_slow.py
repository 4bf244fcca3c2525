"""The long fuzz (`-m slow`): ≥ 10,000 cases in all over every gRPC method and every HTTP route, counted,
then every server must still serve (issue #12: "≥ 10,000 cases in total under `slow`")."""

from __future__ import annotations

import httpx
import pytest

from kvpool.router.model_info import ModelInfo
from tests.fuzz import grpc_fuzz, http_fuzz
from tests.fuzz.cluster import Cases
from tests.fuzz.grpc_fuzz import Servers
from tests.fuzz.targets import targets
from tests.fuzz.test_grpc import check_still_serving

PER_SERVICE = {"Master": 350, "Store": 300, "Prefill": 500, "Decode": 400}
PER_ROUTE = {"completions": 500, "chat": 500, "models": 100, "health": 50, "metrics": 50}
MIN_TOTAL = 10_000


@pytest.mark.slow
def test_ten_thousand_cases_and_everything_still_serves(
    servers: Servers, router: str, model: ModelInfo
) -> None:
    cases = Cases()  # this test's own count, whatever else ran in the session
    for target in targets():
        grpc_fuzz.fuzz(servers, target, PER_SERVICE[target.service], cases)
    with httpx.Client(base_url=router, timeout=60) as http:
        for ep in http_fuzz.endpoints(model.model_id):
            http_fuzz.fuzz(http, ep, PER_ROUTE[ep.name], cases)
        assert http.get("/health").status_code == 200
    check_still_serving(servers)
    print(f"fuzz cases: {cases.total} total; {cases.per_target}")
    assert cases.total >= MIN_TOTAL, cases.per_target
