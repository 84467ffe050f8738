# Included by hashing.pyx (one extension, timely._native.hashing), after route_bins.pxi: hashing
# Arrow columns and splitting rows by worker. The Python side (timely/columnar/kernels.py) hands
# in numpy views over an array's Arrow buffers; these loops never create a Python object per row.
#
# Invariant relied on by every function here: the value of row i is what pyarrow's
# ``array[i].as_py()`` returns, so out[i] == hash64(that value) exactly as hash64 defines it.

from libc.stdint cimport int8_t, int16_t, int32_t, uint8_t, uint16_t

ctypedef fused column_t:
    int8_t
    int16_t
    int32_t
    int64_t
    uint8_t
    uint16_t
    uint32_t
    uint64_t
    float
    double

ctypedef fused offset_t:
    int32_t
    int64_t

cdef uint64_t HASH_NONE = th_mix(START_NONE ^ 0)
cdef bytes _ALL_VALID = b"\xff"  # stands in for a missing validity bitmap (never read then)


cdef inline bint _is_null(const uint8_t[::1] validity, Py_ssize_t bit) noexcept nogil:
    """True when Arrow validity bit `bit` (LSB-first bitmap) is 0."""
    return not ((validity[bit >> 3] >> (bit & 7)) & 1)


def hash_numeric_column(const column_t[::1] values, validity, Py_ssize_t offset,
                        uint64_t[::1] out) -> None:
    """out[i] = hash64 of row i of a numeric Arrow column.

    ``values`` are the row values (the data buffer already sliced to the array's rows);
    ``validity`` is the Arrow validity bitmap as uint8 (None when no row is null) and ``offset``
    the array's bit offset into it. Integers hash as INT; uint64 values >= 2**63 as the BIGINT of
    their 16-byte two's-complement form (what hash64 does for a Python int that large); floats as
    the Python float they convert to.
    """
    cdef Py_ssize_t n = values.shape[0], i
    cdef bint nullable = validity is not None
    cdef const uint8_t[::1] bits = validity if nullable else _ALL_VALID
    cdef uint64_t w
    if out.shape[0] != n:
        raise ValueError(f"out has {out.shape[0]} slots for {n} values")
    if offset < 0:
        raise ValueError(f"negative bit offset {offset}")
    if nullable:
        if (offset + n + 7) // 8 > bits.shape[0]:
            raise ValueError("validity bitmap too short for the column")
    with nogil:
        for i in range(n):
            if nullable and _is_null(bits, offset + i):
                out[i] = HASH_NONE
            elif column_t is float or column_t is double:
                out[i] = th_mix(START_FLOAT ^ th_double_bits(<double>values[i]))
            elif column_t is uint64_t:
                w = values[i]
                if w >> 63:  # int(w) >= 2**63: BIGINT over (w, 0) little-endian, 16 bytes
                    out[i] = th_mix(th_mix(th_mix(START_BIGINT ^ w) ^ 0) ^ 16)
                else:
                    out[i] = th_mix(START_INT ^ w)
            else:
                # Sign extension: a negative value is its value mod 2**64, as hash64 requires.
                out[i] = th_mix(START_INT ^ <uint64_t><int64_t>values[i])


def hash_binary_column(const offset_t[::1] offsets, const uint8_t[::1] data, validity,
                       Py_ssize_t offset, bint is_str, uint64_t[::1] out) -> None:
    """out[i] = hash64 of row i of a utf8/binary Arrow column (STR tag when ``is_str``, else BYTES).

    ``offsets`` are the n + 1 value offsets of the array's rows (already sliced), indexing
    ``data``; ``validity`` and ``offset`` as in :func:`hash_numeric_column`. Arrow utf8 data is
    UTF-8, the very bytes ``str.encode("utf-8")`` gives, so hashing them equals hash64(str).
    """
    cdef Py_ssize_t n = offsets.shape[0] - 1, i
    cdef bint nullable = validity is not None
    cdef const uint8_t[::1] bits = validity if nullable else _ALL_VALID
    cdef uint64_t start = START_STR if is_str else START_BYTES
    cdef int64_t lo, hi
    if n < 0 or out.shape[0] != n:
        raise ValueError(f"out has {out.shape[0]} slots for {n} values")
    if offset < 0:
        raise ValueError(f"negative bit offset {offset}")
    if nullable:
        if (offset + n + 7) // 8 > bits.shape[0]:
            raise ValueError("validity bitmap too short for the column")
    for i in range(n + 1):  # checked once, so the hot loop below reads in bounds
        if offsets[i] < 0 or offsets[i] > data.shape[0] or (i and offsets[i] < offsets[i - 1]):
            raise ValueError(f"invalid Arrow offsets at position {i}")
    with nogil:
        for i in range(n):
            if nullable and _is_null(bits, offset + i):
                out[i] = HASH_NONE
                continue
            lo = offsets[i]
            hi = offsets[i + 1]
            out[i] = th_hash_buf(start, &data[0] + lo if data.shape[0] else NULL, <size_t>(hi - lo))


def hash_none_column(uint64_t[::1] out) -> None:
    """out[i] = hash64(None) for every i (a column of nulls)."""
    cdef Py_ssize_t i
    for i in range(out.shape[0]):
        out[i] = HASH_NONE


def hash_tuple_columns(columns: Sequence, uint64_t[::1] out) -> None:
    """out[i] = hash64 of the tuple (v1, v2, ...) of row i, given the per-column hashes
    ``columns`` (C-contiguous uint64 arrays of out's length): h = start(SEQ), absorb each
    hash64(v_j) in order, then absorb the tuple's length."""
    cdef Py_ssize_t n = out.shape[0], i, j, m = len(columns)
    cdef const uint64_t[::1] col
    cdef uint64_t h
    views = []  # keeps every column's buffer alive while `cols` points into it
    cdef const uint64_t **cols = <const uint64_t **>PyMem_Malloc(max(m, 1) * sizeof(uint64_t *))
    if cols == NULL:
        raise MemoryError()
    try:
        for j in range(m):
            col = columns[j]
            if col.shape[0] != n:
                raise ValueError(f"column of {col.shape[0]} hashes for {n} rows")
            views.append(col)
            cols[j] = &col[0] if n else NULL
        with nogil:
            for i in range(n):  # row by row: each row's hashes are read once, out written once
                h = START_SEQ
                for j in range(m):
                    h = th_mix(h ^ cols[j][i])
                out[i] = th_mix(h ^ <uint64_t>m)
    finally:
        PyMem_Free(cols)


def worker_order(const uint64_t[::1] hashes, peers: int, int64_t[::1] order,
                 int64_t[::1] starts) -> None:
    """Counting sort of the rows by worker ``hashes[i] % peers``.

    Fills ``order`` (n slots) with the row numbers grouped by worker, ascending within each
    worker, and ``starts`` (peers + 1 slots) so that worker w's rows are order[starts[w]:starts[w+1]].
    """
    cdef Py_ssize_t P = _check_peers(peers), n = hashes.shape[0], i, w
    cdef uint64_t mask = <uint64_t>(P - 1), p = <uint64_t>P
    cdef bint pow2 = (P & (P - 1)) == 0
    cdef int64_t *cursor
    if order.shape[0] != n or starts.shape[0] != P + 1:
        raise ValueError("order needs len(hashes) slots and starts peers + 1")
    cursor = <int64_t *>PyMem_Calloc(P, sizeof(int64_t))
    if cursor == NULL:
        raise MemoryError()
    try:
        with nogil:
            for i in range(n):  # count per worker
                w = <Py_ssize_t>(hashes[i] & mask if pow2 else hashes[i] % p)
                cursor[w] += 1
            starts[0] = 0
            for w in range(P):  # counts -> start positions (the cursors)
                starts[w + 1] = starts[w] + cursor[w]
                cursor[w] = starts[w]
            for i in range(n):  # place rows in ascending order: a stable sort
                w = <Py_ssize_t>(hashes[i] & mask if pow2 else hashes[i] % p)
                order[cursor[w]] = i
                cursor[w] += 1
    finally:
        PyMem_Free(cursor)
