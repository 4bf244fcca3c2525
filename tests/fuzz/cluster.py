"""The fuzz cluster's limits and the case counter (shared by the fixtures and the fuzz loops).

Limits are set low so the fuzz is cheap and crosses them often: prompts of at most `MAX_PROMPT` tokens on
the nodes and the router, and at most `MAX_NEW` new tokens per HTTP request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCK = 16
MAX_PROMPT = 256
MAX_NEW = 16
SEGMENT = "256MiB"


@dataclass
class Cases:
    """Counts the fuzz cases sent, per target, over the session (the slow test asserts the total)."""

    per_target: dict[str, int] = field(default_factory=dict)

    def add(self, target: str, n: int = 1) -> None:
        self.per_target[target] = self.per_target.get(target, 0) + n

    @property
    def total(self) -> int:
        return sum(self.per_target.values())
