"""A store node's free list as numpy columns (`kvpool.master.free_slots`): FIFO reuse, no slot handed out
twice, deferred frees, and an inventory's adoption releasing only the slots it did not list."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.master.free_slots import FreeSlots
from kvpool.master.nodes import NodeRecord


def _all_free(n: int, gen: int = 5) -> FreeSlots:
    f = FreeSlots(n)
    f.release_unused(np.zeros(n, dtype=bool), gen)
    return f


def test_starts_allocated_and_release_unused_skips_the_inventory() -> None:
    f = FreeSlots(6)
    assert len(f) == 0 and not f
    used = np.zeros(6, dtype=bool)
    used[[1, 4]] = True
    assert f.release_unused(used, 9) == 4
    slots, gens = f.take(4)
    assert slots.tolist() == [0, 2, 3, 5] and gens.tolist() == [9] * 4
    with pytest.raises(ValueError):
        f.take(1)


def test_fifo_reuse_and_wraparound() -> None:
    f = _all_free(4)
    a, _ = f.take(3)  # 0 1 2
    f.give_back(1, 11)
    f.give_back(0, 10)
    slots, gens = f.take(3)  # the oldest first: 3, then 1 and 0 in the order given back (ring wraps)
    assert slots.tolist() == [3, 1, 0] and gens.tolist() == [5, 11, 10]
    assert len(f) == 0


def test_no_slot_is_handed_out_twice() -> None:
    f = _all_free(3)
    f.take(3)
    f.give_back(2, 7)
    f.give_back(2, 8)  # a repeated acknowledgement: ignored
    f.give_back(9, 1)  # out of range: ignored
    f.give_back(-1, 1)
    assert len(f) == 1
    slots, gens = f.take(1)
    assert slots.tolist() == [2] and gens.tolist() == [7]


def test_pending_until_acknowledged() -> None:
    f = _all_free(2)
    f.take(2)
    f.mark_pending(0, 3)
    assert f.is_pending(0) and not f.is_free(0) and len(f) == 0
    f.give_back(0, 3)
    assert f.is_free(0) and not f.is_pending(0) and len(f) == 1


def test_adoption_keeps_slots_given_back_meanwhile() -> None:
    """A block adopted early in an inventory may be evicted and freed before the adoption ends: its slot is
    free at the store's new generation, neither lost nor freed twice."""
    f = _all_free(4)
    f.allocate_all()
    assert len(f) == 0
    f.give_back(2, 42)  # adopted in slot 2, then freed by the store
    f.give_back(0, 41)  # a free order of the earlier epoch acknowledged meanwhile
    used = np.zeros(4, dtype=bool)
    used[[2, 3]] = True
    assert f.release_unused(used, 99) == 1
    assert len(f) == 3
    slots, gens = f.take(3)
    assert sorted(zip(slots.tolist(), gens.tolist(), strict=True)) == [(0, 41), (1, 99), (2, 42)]


def test_node_record_allocates_locations() -> None:
    rec = NodeRecord("s1", "store", "g", "d", 1, 3, 64)
    assert rec.num_allocated == 3  # nothing free before an adoption
    rec.reset_slots(np.array([False, True, False]), 8)
    assert rec.num_allocated == 1 and rec.used_fraction == pytest.approx(1 / 3)
    locs = rec.take(2)
    assert [(x.node_id, x.slot, x.generation) for x in locs] == [("s1", 0, 8), ("s1", 2, 8)]
    with pytest.raises(ValueError):
        rec.reset_slots(np.zeros(2, dtype=bool), 1)
