"""Required capabilities: a skip whose reason cites one that `KVPOOL_TEST_REQUIRE` names is a failure.

Tests skip for a missing host capability through `tests/capabilities.py`, with the reason
`needs <capability>: <why>`. CI exports `KVPOOL_TEST_REQUIRE=ucx,etcd,...` (`.ci/run`): there such a skip
fails the test, saying which capability was required and why it was missing. Without the variable skips
stay skips (listed by `-rs`). An unknown name in the variable is a usage error at start-up.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests import capabilities


def pytest_configure(config: pytest.Config) -> None:
    try:
        config.stash[_REQUIRED] = capabilities.required()
    except capabilities.UnknownCapability as exc:
        raise pytest.UsageError(f"{capabilities.REQUIRE_ENV}: {exc}") from None


def pytest_report_header(config: pytest.Config) -> str:
    names = sorted(config.stash.get(_REQUIRED, frozenset()))
    return f"required capabilities ({capabilities.REQUIRE_ENV}): {', '.join(names) or 'none'}"


_REQUIRED = pytest.StashKey[frozenset[str]]()


def _refuse_required_skip(config: pytest.Config, report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turn `report`, a skip citing a required capability, into a failure (in place)."""
    if not report.skipped or hasattr(report, "wasxfail") or not isinstance(report.longrepr, tuple):
        return
    message = str(report.longrepr[2])
    capability = capabilities.capability_of(message)
    if capability is None or capability not in config.stash.get(_REQUIRED, frozenset()):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"required capability missing: {capability} ({capabilities.REQUIRE_ENV} names it), "
        f"so this skip is a failure.\n{message}"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _refuse_required_skip(item.config, report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _refuse_required_skip(collector.config, report)
    return report
