"""Tests for timely.columnar.kernels: column hashing against the row path's hash64, worker_parts
and bins_of_hashes against Python loops, Aggregation against a plain-Python group-by oracle."""
from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timely.columnar import kernels
from timely.columnar.kernels import Aggregation, bins_of_hashes, hash_array, hash_columns, worker_parts
from timely.routing import bins_of, hash64

# ------------------------------------------------------------------------------------------------
# Random columns of every supported type, with nulls
# ------------------------------------------------------------------------------------------------

TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)  # Arrow holds no surrogates


def _ints(bits: int, signed: bool) -> st.SearchStrategy:
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0]))


VALUE_TYPES: list[tuple[pa.DataType, st.SearchStrategy]] = [
    *[(getattr(pa, f"int{b}")(), _ints(b, True)) for b in (8, 16, 32, 64)],
    *[(getattr(pa, f"uint{b}")(), _ints(b, False)) for b in (8, 16, 32, 64)],
    (pa.bool_(), st.booleans()),
    (pa.float32(), st.floats(width=32)),
    (pa.float64(), st.one_of(st.floats(), st.sampled_from([-0.0, math.nan, -math.nan, math.inf]))),
    (pa.string(), TEXT),
    (pa.large_string(), TEXT),
    (pa.binary(), st.binary(max_size=40)),
    (pa.large_binary(), st.binary(max_size=40)),
    (pa.string_view(), TEXT),
]


@st.composite
def typed_values(draw, size: int | None = None) -> tuple[pa.DataType, list]:
    t, values = draw(st.sampled_from(VALUE_TYPES))
    items = st.one_of(st.none(), values)
    if size is None:
        return t, draw(st.lists(items, max_size=30))
    return t, draw(st.lists(items, min_size=size, max_size=size))


@st.composite
def arrays(draw, size: int | None = None) -> pa.Array | pa.ChunkedArray:
    """A random column, in one of the layouts hash_array must handle: plain, sliced (offset != 0),
    chunked (with empty chunks), dictionary-encoded, or a sliced dictionary."""
    t, values = draw(typed_values(size))
    layout = draw(st.sampled_from(["plain", "sliced", "chunked", "dictionary", "sliced-dictionary"]))
    head, tail = (draw(st.integers(0, 12)), draw(st.integers(0, 3))) if layout.startswith("sliced") else (0, 0)
    arr = pa.array([None] * head + values + [None] * tail, t)
    if layout.endswith("dictionary") and not pa.types.is_string_view(t):
        arr = arr.dictionary_encode()
    arr = arr.slice(head, len(values))  # offset != 0 when sliced
    if layout == "chunked":
        cuts = sorted(draw(st.lists(st.integers(0, len(values)), max_size=4)))
        bounds = [0, *cuts, len(values)]
        arr = pa.chunked_array([arr.slice(a, b - a) for a, b in zip(bounds, bounds[1:])], t)
    return arr


def _oracle(values: list) -> list[int]:
    return [hash64(v) for v in values]


# ------------------------------------------------------------------------------------------------
# hash_array / hash_columns
# ------------------------------------------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(arrays())
def test_hash_array_matches_hash64_of_each_value(arr):
    got = hash_array(arr)
    assert got.dtype == np.uint64
    assert got.tolist() == _oracle(arr.to_pylist())


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3).flatmap(lambda k: st.integers(0, 12).flatmap(
    lambda n: st.lists(arrays(size=n), min_size=k, max_size=k))))
def test_hash_columns_of_several_columns_is_hash64_of_the_row_tuple(cols):
    names = [f"c{i}" for i in range(len(cols))]
    table = pa.table({name: col for name, col in zip(names, cols)})
    rows = list(zip(*(col.to_pylist() for col in cols)))
    expected = [hash64(r) for r in rows] if len(cols) > 1 else [hash64(r[0]) for r in rows]
    assert hash_columns(table, names).tolist() == expected
    if len(cols) == 1:  # one name, as a str or a one-element sequence: the value itself
        assert hash_columns(table, names[0]).tolist() == expected
    batch = table.combine_chunks().to_batches()
    if batch:
        assert hash_columns(batch[0], names).tolist() == expected


def test_hash_special_values():
    assert hash_array(pa.array([2**64 - 1, 2**63, 2**63 - 1], pa.uint64())).tolist() == \
        [hash64(2**64 - 1), hash64(2**63), hash64(2**63 - 1)]
    assert hash_array(pa.array([True, False, None])).tolist() == [hash64(1), hash64(0), hash64(None)]
    assert hash_array(pa.array([-0.0, float("nan")])).tolist() == [hash64(0.0), hash64(float("nan"))]
    assert hash_array(pa.array([1.5], pa.float16())).tolist() == [hash64(1.5)]
    assert hash_array(pa.array([None, None], pa.null())).tolist() == [hash64(None)] * 2
    assert hash_array(pa.array([], pa.string())).tolist() == []
    assert hash_array(pa.chunked_array([], pa.int64())).tolist() == []
    long = "ü" * 100_000
    assert hash_array(pa.array([long, ""], pa.large_string())).tolist() == [hash64(long), hash64("")]
    # Row path and columnar path agree on the worker of each key.
    keys = [0, -5, 2**40, 7]
    assert hash_array(pa.array(keys)).tolist() == [hash64(k) for k in keys]


def test_hash_columns_errors_name_the_column():
    batch = pa.record_batch({"a": [1, 2], "t": pa.array([[1], [2]])})
    with pytest.raises(KeyError, match=r"'b' not in the batch \(columns: a, t\)"):
        hash_columns(batch, "b")
    with pytest.raises(TypeError, match=r"key column 't' has type list<item: int64>"):
        hash_columns(batch, ["a", "t"])
    with pytest.raises(TypeError, match="cannot hash Arrow type timestamp"):
        hash_array(pa.array([0], pa.timestamp("s")))
    with pytest.raises(ValueError, match="at least one column"):
        hash_columns(batch, [])


# ------------------------------------------------------------------------------------------------
# worker_parts / bins_of_hashes
# ------------------------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=60), st.integers(1, 9))
def test_worker_parts_against_a_loop(hashes, peers):
    parts = worker_parts(np.array(hashes, np.uint64), peers)
    assert len(parts) == peers
    for w, part in enumerate(parts):
        assert part.dtype == np.int64
        assert part.tolist() == [i for i, h in enumerate(hashes) if h % peers == w]


def test_worker_parts_rejects_bad_peers():
    with pytest.raises(ValueError, match="peers must be between 1"):
        worker_parts(np.zeros(3, np.uint64), 0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40), st.integers(0, 16))
def test_bins_of_hashes_matches_bins_of(keys, k):
    got = bins_of_hashes(hash_array(pa.array(keys, pa.int64())), k)
    assert got.tolist() == bins_of(keys, None, k)


def test_bins_of_hashes_rejects_bad_k():
    with pytest.raises(ValueError, match="k \\(bin bits\\) must be an int in 0..16"):
        bins_of_hashes(np.zeros(1, np.uint64), 17)


# ------------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------------

AGG_SCHEMA = pa.schema([("k", pa.int64()), ("s", pa.dictionary(pa.int32(), pa.string())),
                        ("i", pa.int32()), ("f", pa.float64()), ("u", pa.uint16())])
AGGS = {"i": ["count", "sum", "min", "max", "mean"], "f": ["sum", "mean", "max"],
        "u": "sum", "s": ["count", "min"]}


@st.composite
def agg_rows(draw) -> list[dict]:
    row = st.fixed_dictionaries({
        "k": st.one_of(st.none(), st.integers(-3, 3)),
        "s": st.one_of(st.none(), st.sampled_from(["x", "y", "zé"])),
        "i": st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)),
        "f": st.one_of(st.none(), st.floats(-1e6, 1e6)),
        "u": st.one_of(st.none(), st.integers(0, 2**16 - 1)),
    })
    return draw(st.lists(row, max_size=60))


def _agg_oracle(rows: list[dict], keys: list[str]) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = {}
    for key, members in groups.items():
        res = {}
        for column, fns in AGGS.items():
            vals = [r[column] for r in members if r[column] is not None]
            for fn in [fns] if isinstance(fns, str) else fns:
                res[f"{column}_{fn}"] = (
                    len(vals) if fn == "count" else None if not vals
                    else sum(vals) if fn == "sum" else min(vals) if fn == "min"
                    else max(vals) if fn == "max" else sum(vals) / len(vals))
        out[key] = res
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
    return a == b


@settings(max_examples=120, deadline=None)
@given(agg_rows(), st.lists(st.integers(0, 60), max_size=8), st.sampled_from([["k"], ["k", "s"], ["s"]]),
       st.sampled_from([(kernels.BUFFER_ROWS, kernels.MAX_PARTIALS), (1, 1), (7, 2)]))
def test_aggregation_against_python_oracle(rows, cuts, keys, limits):
    table = pa.Table.from_pylist(rows, schema=AGG_SCHEMA)
    bounds = [0, *sorted(min(c, len(rows)) for c in cuts), len(rows)]
    agg = Aggregation(keys, AGGS, AGG_SCHEMA)
    with mock.patch.object(kernels, "BUFFER_ROWS", limits[0]), mock.patch.object(kernels, "MAX_PARTIALS", limits[1]):
        for a, b in zip(bounds, bounds[1:]):  # arbitrary splits, empty batches included
            part = table.slice(a, b - a)
            agg.update(part.combine_chunks().to_batches()[0] if b > a else pa.RecordBatch.from_pylist([], AGG_SCHEMA))
        result = agg.finish()
    assert result.schema == agg.schema
    got = {tuple(r[k] for k in keys): {n: v for n, v in r.items() if n not in keys}
           for r in result.to_pylist()}
    expected = _agg_oracle(rows, keys)
    assert len(got) == result.num_rows == len(expected)
    assert got.keys() == expected.keys()
    for key, res in expected.items():
        for name, value in res.items():
            assert (value is None and got[key][name] is None) or _same(got[key][name], value), (key, name)


def test_aggregation_schema_and_incremental_finish():
    agg = Aggregation("k", AGGS, AGG_SCHEMA)
    assert agg.schema.names == ["k", "i_count", "i_sum", "i_min", "i_max", "i_mean", "f_sum", "f_mean",
                                "f_max", "u_sum", "s_count", "s_min"]
    types = dict(zip(agg.schema.names, agg.schema.types))
    assert types["i_count"] == types["i_sum"] == types["u_sum"] == pa.int64()
    assert types["i_mean"] == types["f_sum"] == pa.float64()
    assert types["i_min"] == pa.int32() and types["s_min"] == pa.string()
    empty = agg.finish()
    assert empty.num_rows == 0 and empty.schema == agg.schema
    batch = pa.RecordBatch.from_pylist([{"k": 1, "s": "a", "i": 2, "f": 0.5, "u": 3}], AGG_SCHEMA)
    agg.update(batch)
    assert agg.finish().to_pylist()[0]["i_sum"] == 2
    agg.update(batch)  # finish keeps the state
    row = agg.finish().to_pylist()[0]
    assert (row["i_sum"], row["i_count"], row["i_mean"], row["s_min"]) == (4, 2, 2.0, "a")


def test_aggregation_validation_names_column_and_function():
    with pytest.raises(ValueError, match=r"aggregation 'sum' of column 'nope': no such column"):
        Aggregation(["k"], {"nope": "sum"}, AGG_SCHEMA)
    with pytest.raises(ValueError, match=r"column 'i': unsupported function 'median'"):
        Aggregation(["k"], {"i": ["sum", "median"]}, AGG_SCHEMA)
    with pytest.raises(ValueError, match=r"aggregation 'mean' of column 's': needs a numeric column"):
        Aggregation(["k"], {"s": "mean"}, AGG_SCHEMA)
    with pytest.raises(ValueError, match=r"key column 'x' is not in the schema"):
        Aggregation(["x"], {"i": "sum"}, AGG_SCHEMA)
    with pytest.raises(ValueError, match="at least one key"):
        Aggregation([], {"i": "sum"}, AGG_SCHEMA)
    schema = pa.schema([("k", pa.int64()), ("l", pa.list_(pa.int64())), ("l_count", pa.int64())])
    unordered = r"aggregation 'max' of column 'l': pyarrow has no grouped min/max for type list<item: int64>"
    with pytest.raises(ValueError, match=unordered):
        Aggregation(["k"], {"l": "max"}, schema)
    with pytest.raises(ValueError, match="output columns collide"):
        Aggregation(["l_count"], {"l": "count"}, schema)
    agg = Aggregation(["k"], {"i": "sum"}, AGG_SCHEMA)
    with pytest.raises(ValueError, match=r"column 'i' has type int64, expected int32"):
        agg.update(pa.record_batch({"k": [1], "i": [1]}))
    with pytest.raises(KeyError, match="'k' not in the batch"):
        agg.update(pa.record_batch({"i": pa.array([1], pa.int32())}))
