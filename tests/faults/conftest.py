"""Fixtures shared by the fault suite."""

from __future__ import annotations

import pytest

from tests.faults.common import BLOCK


@pytest.fixture(scope="module")
def runner():  # type: ignore[no-untyped-def]
    """The embedded model in this process: the cold reference every answer is checked against."""
    pytest.importorskip("torch")
    from kvpool.model import ModelRunner

    return ModelRunner.load(None, block_size=BLOCK)
