"""The global radix index: a pure data structure (stdlib, numpy, `kvpool.types`, `kvpool.errors`)."""

from kvpool.index.policies import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    BeladyPolicy,
    BlockStats,
    EvictionPolicy,
    FrequencyWeightedLRUPolicy,
    GDSFPolicy,
    LFUPolicy,
    LRUPolicy,
    make_policy,
)
from kvpool.index.radix import RadixIndex
from kvpool.index.results import (
    BlockInfo,
    BulkInsertResult,
    DroppedBlock,
    EvictResult,
    InsertResult,
    MatchResult,
)

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "BeladyPolicy",
    "BlockInfo",
    "BlockStats",
    "BulkInsertResult",
    "DroppedBlock",
    "EvictResult",
    "EvictionPolicy",
    "FrequencyWeightedLRUPolicy",
    "GDSFPolicy",
    "InsertResult",
    "LFUPolicy",
    "LRUPolicy",
    "MatchResult",
    "RadixIndex",
    "make_policy",
]
