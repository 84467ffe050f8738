# Included by hashing.pyx (one extension, timely._native.hashing): hashing the keys of a batch,
# and the batch functions partition, hash_batch and bins_of. route_bins is in route_bins.pxi.

MAX_BIN_BITS = 16  # bins_of / route_bins accept k in 0..MAX_BIN_BITS

# For the annotations only (annotation_typing=False: Cython does not enforce them).
from collections.abc import Callable, Sequence
from typing import Any, Union
Key = Union[int, None, Callable[[Any], Any]]

# ---------------------------------------------------------------------------------------------
# Hashing the keys of a batch
# ---------------------------------------------------------------------------------------------

cdef object _record_repr(object rec):
    try:
        r = repr(rec)
    except Exception as e:  # a broken __repr__ must not hide the real error
        r = f"<{type(rec).__qualname__} object, repr failed: {type(e).__name__}>"
    return r if len(r) <= 200 else r[:197] + "..."


cdef int _bad_record(object e, object seq, Py_ssize_t i) except -1:
    """Re-raise an error about record i with its position and (truncated) repr in the message."""
    for cls in (IndexError, TypeError, OverflowError, RecursionError, ValueError):
        if isinstance(e, cls):
            break
    else:
        raise e
    rec = seq[i] if i < len(seq) else "<gone>"
    raise cls(f"record at position {i} of the batch: {e}; record = {_record_repr(rec)}") from e


cdef object _as_batch(object records):
    """The batch as a list or tuple (other iterables are copied into a list)."""
    if isinstance(records, (list, tuple)):
        return records
    return list(records)


cdef int _key_hashes(object seq, object key, uint64_t *out, PyObject **refs) except -1:
    """out[i] = hash64(key of record i) for every record of seq (a list or tuple).

    If refs is not NULL, refs[i] receives a new (strong) reference to record i: on success the
    caller owns all n of them; on failure none is left. Taking the reference while the record is
    in cache lets _scatter fill the output lists without touching the records again.
    """
    cdef Py_ssize_t n = len(seq), i = 0, field = 0, j, size, held = 0
    cdef PyObject *rec
    cdef PyObject *item
    cdef int mode, calling = 0
    cdef object k
    if key is None:
        mode = 0
    elif isinstance(key, int):
        mode = 1
        field = key
    elif callable(key):
        mode = 2
    else:
        raise TypeError(f"key must be None, an int field index or a callable, not {type(key).__qualname__}")
    try:
        for i in range(n):
            # Only user code (a key callable, or a __del__ run by the GC) could resize the batch.
            if PySequence_Fast_GET_SIZE(<PyObject *>seq) != n:
                raise RuntimeError("the batch was modified while it was being routed")
            rec = PySequence_Fast_GET_ITEM(<PyObject *>seq, i)
            Py_INCREF(rec)  # keeps rec alive whatever happens to the batch meanwhile
            if refs != NULL:
                refs[i] = rec
                held = i + 1
            try:
                if mode == 1:
                    if not (PyTuple_Check(rec) or PyList_Check(rec)):
                        raise TypeError(f"an int key needs tuple or list records, not {type(<object>rec).__qualname__}")
                    size = PySequence_Fast_GET_SIZE(rec)  # a tuple's or a list's size and items
                    j = field if field >= 0 else field + size
                    if j < 0 or j >= size:
                        raise IndexError(f"field index {field} out of range for a record of {size} fields")
                    # Hold the field while hashing it: hashing may allocate, and a GC pass may run
                    # a __del__ that mutates a list record.
                    item = PySequence_Fast_GET_ITEM(rec, j)
                    Py_INCREF(item)
                    try:
                        _hash(item, &out[i])
                    finally:
                        Py_DECREF(item)
                elif mode == 0:
                    _hash(rec, &out[i])
                else:
                    calling = 1
                    k = key(<object>rec)
                    calling = 0
                    _hash(<PyObject *>k, &out[i])
            finally:
                if refs == NULL:
                    Py_DECREF(rec)
    except BaseException as e:
        _release(refs, held)
        if calling:  # the user's key function failed: keep its exception, say which record
            if hasattr(e, "add_note"):
                e.add_note(f"while computing the key of record at position {i} of the batch: "
                           f"{_record_repr(seq[i])}")
            raise
        if isinstance(e, RuntimeError) and not isinstance(e, RecursionError):
            raise
        _bad_record(e, seq, i)
    return 0


cdef void _release(PyObject **refs, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i
    if refs != NULL:
        for i in range(n):
            Py_DECREF(refs[i])


cdef object _scatter(PyObject **refs, Py_ssize_t n, uint32_t *target, Py_ssize_t peers,
                     uint32_t *bin_of):
    """Move the n record references into `peers` new lists by target[i], preserving order; with
    bin_of, also build the parallel lists of bin numbers. Always consumes all n references.
    Two passes: count per target, then fill pre-sized lists (no appends, no reallocation)."""
    cdef Py_ssize_t i, p
    cdef PyObject *b
    cdef list outs = [], bouts = []
    # Two arrays in one block: count[p] (then the fill cursor) and dst[p] (the output's items).
    cdef Py_ssize_t *count = <Py_ssize_t *>PyMem_Malloc(peers * (sizeof(Py_ssize_t) + sizeof(PyObject **)))
    cdef PyObject ***dst = <PyObject ***>(count + peers)
    if count == NULL:
        _release(refs, n)
        raise MemoryError()
    try:
        try:
            for p in range(peers):
                count[p] = 0
            for i in range(n):
                count[target[i]] += 1
            for p in range(peers):
                outs.append(PyList_New(count[p]))
                if bin_of != NULL:
                    bouts.append(PyList_New(count[p]))
        except BaseException:
            _release(refs, n)
            raise
        # From here nothing can fail until every reference has been moved.
        for p in range(peers):
            dst[p] = PySequence_Fast_ITEMS(PyList_GET_ITEM(<PyObject *>outs, p))
        for i in range(n):
            p = target[i]
            dst[p][0] = refs[i]  # the list takes over our reference
            dst[p] += 1
        if bin_of != NULL:
            for p in range(peers):
                dst[p] = PySequence_Fast_ITEMS(PyList_GET_ITEM(<PyObject *>bouts, p))
            for i in range(n):
                # Small ints (< 257) are cached; others are allocated. On MemoryError the lists
                # still hold NULL slots, which list deallocation accepts.
                b = PyLong_FromUnsignedLong(bin_of[i])
                if b == NULL:
                    raise MemoryError()
                p = target[i]
                dst[p][0] = b
                dst[p] += 1
    finally:
        PyMem_Free(count)
    return (outs, bouts) if bin_of != NULL else outs


cdef uint64_t *_alloc_words(Py_ssize_t n) except NULL:
    cdef uint64_t *p = <uint64_t *>PyMem_Malloc(max(n, 1) * sizeof(uint64_t))
    if p == NULL:
        raise MemoryError()
    return p


cdef Py_ssize_t _check_peers(peers) except -1:
    cdef Py_ssize_t p = peers
    if p < 1 or p > 0xFFFFFFFF:
        raise ValueError(f"peers must be between 1 and 2**32 - 1, got {peers}")
    return p


cdef int _check_k(k) except -1:
    if not isinstance(k, int) or not 0 <= k <= MAX_BIN_BITS:
        raise ValueError(f"k (bin bits) must be an int in 0..{MAX_BIN_BITS}, got {k!r}")
    return k


# ---------------------------------------------------------------------------------------------
# Public batch functions
# ---------------------------------------------------------------------------------------------

def partition(records: Sequence, peers: int, key: Key) -> list[list]:
    """Split ``records`` into ``peers`` lists: record r goes to ``hash64(key of r) % peers``.

    Record order is preserved within each target list. ``key`` is an int field index, None (the
    whole record) or a callable. A record whose key is missing or unhashable raises
    IndexError/TypeError naming the record and its position in the batch.
    """
    cdef Py_ssize_t P = _check_peers(peers), n, i
    cdef uint64_t mask
    seq = _as_batch(records)
    n = len(seq)
    cdef uint64_t *h = _alloc_words(2 * n)          # n hashes, then n record references
    cdef PyObject **refs = <PyObject **>(h + n)
    cdef uint32_t *t = <uint32_t *>h  # targets overwrite the hashes in place: t[i] sits in bytes
                                      # 4i..4i+3, h[i] is read first and h[j>i] starts at 8j > 4i+3
    try:
        _key_hashes(seq, key, h, refs)
        if P & (P - 1) == 0:  # power of two: & (P-1) is the same number as % P
            mask = <uint64_t>(P - 1)
            for i in range(n):
                t[i] = <uint32_t>(h[i] & mask)
        else:
            for i in range(n):
                t[i] = <uint32_t>(h[i] % <uint64_t>P)
        return _scatter(refs, n, t, P, NULL)
    finally:
        PyMem_Free(h)


def hash_batch(records: Sequence, key: Key) -> list[int]:
    """``[hash64(key of r) for r in records]`` as a list of ints (same ``key`` conventions as
    :func:`partition`)."""
    cdef Py_ssize_t n, i
    seq = _as_batch(records)
    n = len(seq)
    cdef uint64_t *h = _alloc_words(n)
    try:
        _key_hashes(seq, key, h, NULL)
        return [h[i] for i in range(n)]
    finally:
        PyMem_Free(h)


def bins_of(records: Sequence, key: Key, k: int, counts: Any = None) -> list[int]:
    """Megaphone bin of each record: the top ``k`` bits of its key's hash64, ``hash >> (64 - k)``,
    for k in 0..16 (k == 0 puts every record in bin 0). ``counts``: a writable buffer of ``2**k``
    int64 (a numpy array) to which each record adds 1 at its bin (the per-bin load, counted here
    in the same pass at no extra cost)."""
    cdef int bits = _check_k(k)
    cdef Py_ssize_t n, i
    cdef int64_t[::1] c
    seq = _as_batch(records)
    n = len(seq)
    if counts is not None:
        c = counts
        if c.shape[0] != (<Py_ssize_t>1 << bits):
            raise ValueError(f"bins_of: counts must have 2**k = {1 << bits} entries, not {c.shape[0]}")
    cdef uint64_t *h = _alloc_words(n)
    try:
        _key_hashes(seq, key, h, NULL)
        if bits == 0:  # a shift by 64 is undefined in C
            if counts is not None:
                c[0] += n
            return [0] * n
        for i in range(n):
            h[i] >>= 64 - bits
        if counts is not None:
            for i in range(n):
                c[h[i]] += 1
        return [h[i] for i in range(n)]
    finally:
        PyMem_Free(h)


def add_keys(bins: list, records: Sequence, tracked: dict) -> None:
    """For each record whose bin (``bins[i]``, as :func:`bins_of` gives them) has a set in
    ``tracked``, add the record's field 0 to that set: the state keys ``state_machine`` records
    reach, per bin copied ahead or replicated (``megaphone.precopy``). One pass, no Python calls."""
    cdef Py_ssize_t i, n = len(bins)
    seq = _as_batch(records)
    if len(seq) != n:
        raise ValueError(f"add_keys: {n} bins for {len(seq)} records")
    cdef object s
    for i in range(n):
        s = tracked.get(bins[i])
        if s is not None:
            (<set?>s).add(seq[i][0])


from cpython.dict cimport PyDict_GetItemWithError
from cpython.ref cimport PyObject


def gather(state, keys) -> tuple:
    """The entries of ``state`` for ``keys`` (any iterable of keys) as a dict, and the keys that
    ``state`` lacks as a list: one lookup per key, read as a plain dict (a subclass's
    ``__getitem__`` is not called). ``megaphone.precopy`` ships a bin's changed keys with it."""
    cdef dict found = {}
    cdef list absent = []
    cdef PyObject *v
    if not isinstance(state, dict):
        raise TypeError(f"gather: expected a dict, not {type(state).__name__}")
    for k in keys:
        v = PyDict_GetItemWithError(state, k)
        if v is NULL:
            absent.append(k)
        else:
            found[k] = <object>v
    return found, absent
