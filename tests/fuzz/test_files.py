"""Malformed cluster specs and traces give clear errors naming the file, the line and the field, never a
stack trace (issue #12, bad input). No cluster needed: the loaders are pure."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpool.cluster.spec import load_spec
from kvpool.errors import InvalidArgument
from kvpool.trace import load_trace

FILES = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))  # fmt: skip


def _write(data: bytes, suffix: str) -> Path:
    with tempfile.NamedTemporaryFile(suffix=suffix, delete=False) as fh:
        fh.write(data)
    return Path(fh.name)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"replicas = 2\n[master]\nport = 1\n", r":1: replicas: Extra inputs are not permitted"),
        (b"[cluster]\nblock_size = 16\n\nstore = 3\n", r":4: cluster\.store: Extra inputs"),
        (b"store = 3\n", r":1: store: Input should be a valid dictionary"),
        (b"[master]\nport = 99999\n", r":2: master\.port: Input should be less than or equal to 65535"),
        (b'[store]\ncount = "two"\n', r":2: store\.count: Input should be a valid integer"),
        (b'[master]\n\nhost = "\xff"\n', r":3: not UTF-8 text"),
        (b"[master]\nport = = 1\n", r"invalid TOML: .*line 2"),
    ],
    ids=[
        "stray-key",
        "stray-key-in-section",
        "section-as-scalar",
        "port-range",
        "wrong-type",
        "non-utf8",
        "toml",
    ],
)
def test_bad_spec_names_file_line_and_field(text: bytes, expected: str) -> None:
    path = _write(text, ".toml")
    with pytest.raises(InvalidArgument, match=re.escape(str(path)) + ".*" + expected):
        load_spec(path)


@FILES
@given(
    lines=st.lists(
        st.sampled_from(["[master]", "[store]", "[cluster]", "[nope]", "port = 1", "count = -1", 'host = "h"',
                         "replicas = 99", "block_size = 0", "x = [1,", "= 3", "segment_size = 5"])
        | st.text(max_size=20),
        max_size=8,
    )
)  # fmt: skip
def test_fuzzed_specs_load_or_name_the_file(lines: list[str]) -> None:
    path = _write("\n".join(lines).encode("utf-8", "surrogatepass"), ".toml")
    try:
        load_spec(path)
    except InvalidArgument as exc:
        assert str(exc).startswith(str(path)), exc


GOOD = {"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}  # 512-token trace blocks


def _record(**kw: object) -> bytes:
    return json.dumps(GOOD | kw).encode() + b"\n"


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([_record(), b"{nope\n"], r":2: not JSON"),
        ([_record(), _record(timestamp=-1)], r":2: timestamp must be a non-negative int"),
        ([_record(), b'{"timestamp": 1, "hash_ids": []}\n'], r":2: missing 'input_length'"),
        ([_record(input_length="9")], r":1: input_length must be a positive int"),
        ([_record(hash_ids=[1, -2])], r":1: hash_ids must be a list of non-negative ints"),
        ([_record(hash_ids=[1])], r":1: 1 hash_ids for input_length 600"),
        ([_record(), b"\n", b"\xff\xfe\n"], r":3: not UTF-8 text"),
        ([b"[" * 100_000 + b"\n"], r":1: not a usable JSON record"),
        ([b'{"timestamp": ' + b"9" * 5000 + b"}\n"], r":1: not a usable JSON record"),
        ([b"7\n"], r":1: a record must be a JSON object"),
        ([b"\n"], r": no trace records"),
    ],
    ids=["json", "ts", "missing", "type", "ids", "count", "utf8", "nesting", "bigint", "scalar", "empty"],
)
def test_bad_trace_names_file_line_and_field(lines: list[bytes], expected: str) -> None:
    path = _write(b"".join(lines), ".jsonl")
    with pytest.raises(InvalidArgument, match=re.escape(str(path)) + expected):
        load_trace(path)


def test_missing_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")


@FILES
@given(data=st.binary(max_size=200) | st.lists(st.builds(_record, timestamp=st.integers(-2, 3) | st.text(max_size=3),
                                                         hash_ids=st.lists(st.integers(-1, 3), max_size=3)),
                                               max_size=3).map(b"".join))  # fmt: skip
@example(data=b"\xff\n")  # was UnicodeDecodeError (a stack trace)
@example(data=b"[" * 50_000)  # was RecursionError
@example(data=b'{"timestamp": ' + b"9" * 5000 + b"}")  # was ValueError (int too long)
def test_fuzzed_traces_load_or_name_the_file_and_line(data: bytes) -> None:
    path = _write(data, ".jsonl")
    try:
        load_trace(path)
    except InvalidArgument as exc:
        assert re.match(re.escape(str(path)) + r"(:\d+)?: ", str(exc)), exc
