"""Hypothesis strategies for any protobuf message, derived from its descriptor.

`message(desc, hints)` draws a message of type `desc` whose fields are unset or random: wrong-length and
oversized bytes, huge and boundary integers, NaN/inf floats, unknown enum values, empty, short and
oversized repeated fields, nested messages (to a depth limit) and maps. `hints` maps a field's full
name (`kvpool.v1.PrefillRequest.token_ids`) to a strategy drawn instead of the generic one half the
time (always, when wrapped in `Only`): that is how a fuzz reaches past the first validation into the deep code paths (valid token ids,
the pool's layout fingerprint) while still sending garbage everywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

F = FieldDescriptor
MAX_DEPTH = 3
OVERSIZED = 5000
"""Entries in an oversized repeated field (above every per-request limit of the services)."""


class Only:
    """A hint drawn always, instead of the generic strategy (bounds the model's work per call)."""

    def __init__(self, strategy: st.SearchStrategy[Any]) -> None:
        self.strategy = strategy


Hints = Mapping[str, "st.SearchStrategy[Any] | Only"]


def _ints(bits: int, signed: bool) -> st.SearchStrategy[int]:
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    edges = sorted({lo, hi, 0, 1, hi - 1, 1 << (bits // 2)} | ({-1} if signed else set()))
    return st.integers(0, 6) | st.sampled_from(edges) | st.integers(lo, hi)


_INTS = {
    F.TYPE_INT32: _ints(32, True), F.TYPE_SINT32: _ints(32, True), F.TYPE_SFIXED32: _ints(32, True),
    F.TYPE_INT64: _ints(64, True), F.TYPE_SINT64: _ints(64, True), F.TYPE_SFIXED64: _ints(64, True),
    F.TYPE_UINT32: _ints(32, False), F.TYPE_FIXED32: _ints(32, False),
    F.TYPE_UINT64: _ints(64, False), F.TYPE_FIXED64: _ints(64, False),
}  # fmt: skip

# No "prefill"/"decode": a registered serving node is trusted with the router's traffic, and the HTTP fuzz
# shares this cluster. Fake store nodes are fine: they are never adopted (their address does not answer).
BYTES = (
    st.binary(max_size=40)
    | st.sampled_from([b"", b"\x00" * 16, b"\xff" * 16, b"\x00" * 15, b"\x00" * 17, b"\x01" * 32])
    | st.binary(min_size=16, max_size=16)
    | st.just(b"\xab" * 70_000)
)
STRINGS = (
    st.text(max_size=12)
    | st.sampled_from(["", "store", "router", "x" * 300, "127.0.0.1:1", "\x00", "é" * 5])
    | st.just("y" * 70_000)
)
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1e-300, -1.0, 1e300])


def scalar(field: FieldDescriptor, *, small: bool = False) -> st.SearchStrategy[Any]:
    """A strategy for one value of a scalar field (not a message); `small`: no oversized values."""
    t = field.type
    if small and t in (F.TYPE_STRING, F.TYPE_BYTES):
        return st.sampled_from(["", "x", "é"] if t == F.TYPE_STRING else [b"", b"\x00" * 16, b"\x01"])
    if t in _INTS:
        return _INTS[t]
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return FLOATS
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return STRINGS
    if t == F.TYPE_BYTES:
        return BYTES
    if t == F.TYPE_ENUM:  # proto3 enums are open: unknown numbers must be accepted or refused cleanly
        known = [v.number for v in field.enum_type.values]
        return st.sampled_from(known) | st.integers(-(1 << 31), (1 << 31) - 1)
    raise TypeError(f"unhandled field type {t} of {field.full_name}")


def _value(field: FieldDescriptor, hints: Hints, depth: int) -> st.SearchStrategy[Any]:
    if field.type == F.TYPE_MESSAGE:
        return message(field.message_type, hints, depth + 1)
    return scalar(field)


def _field(field: FieldDescriptor, hints: Hints, depth: int) -> st.SearchStrategy[Any]:
    if field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        key, val = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        generic: st.SearchStrategy[Any] = st.dictionaries(scalar(key), _value(val, hints, depth), max_size=3)
        generic |= st.dictionaries(st.text(min_size=1, max_size=6), st.just("v"), min_size=65, max_size=80)
    elif field.is_repeated:
        one = _value(field, hints, depth)
        generic = st.lists(one, max_size=4)
        if field.type != F.TYPE_MESSAGE:
            generic |= st.builds(lambda v: [v] * OVERSIZED, scalar(field, small=True))
        elif depth < MAX_DEPTH:
            generic |= st.just([GetMessageClass(field.message_type)()] * OVERSIZED)
    else:
        generic = _value(field, hints, depth)
    hint = hints.get(field.full_name)
    if isinstance(hint, Only):
        return hint.strategy
    return generic if hint is None else hint | generic


def message(desc: Descriptor, hints: Hints | None = None, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of type `desc`: each field unset or drawn (see the module docstring)."""
    hints = hints or {}
    cls = GetMessageClass(desc)
    if depth >= MAX_DEPTH:
        return st.just(cls())
    fields = {f.name: _field(f, hints, depth) for f in desc.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def near_valid(desc: Descriptor, hints: Hints) -> st.SearchStrategy[Message] | None:
    """Messages of type `desc` with only the hinted fields set, each drawn from its hint (None when no
    field of `desc` is hinted): mostly valid requests, to reach the deep code paths."""
    cls = GetMessageClass(desc)
    fields = {}
    for f in desc.fields:
        hint = hints.get(f.full_name)
        if hint is not None:
            fields[f.name] = hint.strategy if isinstance(hint, Only) else hint
    if not fields:
        return None
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))
