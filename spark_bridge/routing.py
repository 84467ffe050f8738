"""Which worker owns a key: ``timely.routing.hash64(key) % peers``, computed column-wise.

The Spark side routes each row of a keyed write to the worker that ``stream.exchange(key)`` would
send it to inside the dataflow, so a keyed aggregation right after the source needs no exchange
hop. For integer columns the hash is computed with numpy over the whole Arrow column (the same
splitmix64 definition as ``native/hashing.pyx``); other types go through ``hash64`` per value.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

_SEED = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_MASK = (1 << 64) - 1
_TAG_INT = 2


def _mix_int(z: int) -> int:
    z &= _MASK
    z ^= z >> 30
    z = (z * _M1) & _MASK
    z ^= z >> 27
    z = (z * _M2) & _MASK
    return z ^ (z >> 31)


_START_INT = _mix_int(_SEED ^ _TAG_INT)


def _mix_np(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    import numpy as np

    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(_M1)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def hash_int64(values: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """``hash64(v)`` for every value of an int64 numpy array, as a uint64 array."""
    import numpy as np

    with np.errstate(over="ignore"):
        z = values.astype(np.int64, copy=False).view(np.uint64) ^ np.uint64(_START_INT)
        return _mix_np(z)


def owners(column: Any, peers: int) -> npt.NDArray[np.int64]:
    """The owning worker of every value of an Arrow column (a numpy int array of length n).

    Integer columns without nulls are hashed vectorised; anything else goes through
    ``timely.routing.hash64`` value by value (nulls hash as ``None``).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.types as pt

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    if peers == 1:
        return np.zeros(n, dtype=np.int64)
    if pt.is_integer(column.type) and column.null_count == 0 and not pt.is_uint64(column.type):
        h = hash_int64(column.to_numpy(zero_copy_only=False).astype(np.int64, copy=False))
    else:
        from timely.routing import hash64

        h = np.fromiter((hash64(v) for v in column.to_pylist()), dtype=np.uint64, count=n)
    return (h % np.uint64(peers)).astype(np.int64)


#: Spark types whose Python values (see :mod:`spark_bridge.schema`) ``hash64`` accepts: int, bool,
#: float, None, str, bytes, and lists/tuples of these (arrays; maps are lists of (key, value) pairs).
HASHABLE = frozenset({"boolean", "tinyint", "smallint", "int", "bigint", "float", "double", "string", "binary", "void"})


def hashable(spark_type: str) -> bool:
    """Whether ``keyColumn`` may be a column of ``spark_type`` (a normalised Spark type string):
    not date, timestamp, decimal or struct (``datetime``/``Decimal``/``dict`` values ``hash64``
    refuses), nor an array or map of them."""
    if spark_type in HASHABLE:
        return True
    if spark_type.startswith("array<") and spark_type.endswith(">"):
        return hashable(spark_type[6:-1])
    if spark_type.startswith("map<") and spark_type.endswith(">"):
        from .schema import _split_top

        parts = _split_top(spark_type[4:-1])
        return len(parts) == 2 and all(hashable(p) for p in parts)
    return False
