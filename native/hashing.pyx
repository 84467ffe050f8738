# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, annotation_typing=False
"""Deterministic 64-bit hashing and batch routing (built as ``timely._native.hashing``).

Routing must agree across worker processes and runs, so Python's ``hash()`` (salted per process)
is never used. The hash is defined exactly as follows; all arithmetic is modulo 2**64::

    mix(z)       = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
                   return z ^ (z >> 31)                 # the splitmix64 finaliser (a bijection)
    absorb(h, w) = mix(h ^ w)
    start(tag)   = mix(0x9E3779B97F4A7C15 ^ tag)
    tags:          NONE=1  INT=2  BIGINT=3  FLOAT=4  STR=5  BYTES=6  SEQ=7
    buf(tag, b)  = h = start(tag)
                   for each 8-byte chunk c of b, the last one zero-padded on the right:
                       h = absorb(h, int.from_bytes(c, "little"))
                   return absorb(h, len(b))

    hash64(None)                         = absorb(start(NONE), 0)
    hash64(int v), -2**63 <= v < 2**63   = absorb(start(INT), v mod 2**64)     (bool: True is 1)
    hash64(int v), any other v           = buf(BIGINT, v.to_bytes(8*n, "little", signed=True))
                                           where n = (v.bit_length() + 64) // 64
    hash64(float x)                      = absorb(start(FLOAT), IEEE-754 bits of x as uint64)
                                           with -0.0 hashed as 0.0 and every NaN as 0x7FF8000000000000
    hash64(str s)                        = buf(STR, s.encode("utf-8", "surrogatepass"))
    hash64(bytes | bytearray | memoryview b) = buf(BYTES, bytes(b))
    hash64(tuple | list t)               = h = start(SEQ)
                                           for x in t: h = absorb(h, hash64(x))
                                           return absorb(h, len(t))

Anything else (dict, set, numpy scalars, ...) is a TypeError naming the type. Note that ``1`` and
``1.0`` hash differently (they are different types), while a tuple and a list with equal items hash
equal. Subclasses of int/str/float/tuple/list hash like their base type.

Routing built on the hash:
  * partition target  = hash % peers  (computed as ``hash & (peers - 1)`` when peers is a power of two,
    which is the same number);
  * Megaphone bin     = the TOP k bits, ``hash >> (64 - k)`` (0 when k == 0). Top bits are used so that
    bin b at k bits splits into bins 2b and 2b+1 at k+1 bits; mix() ends with a multiply followed by
    ``z ^ (z >> 31)``, so the high bits are the best-mixed ones.

Every batch function loops over the records in C; the only per-record Python call is the user's key
callable, when one is given. ``key`` is one of: an int field index (``record[key]`` for tuple/list
records, negative indices allowed), ``None`` (hash the whole record), or a callable ``key(record)``.
"""
from libc.stdint cimport uint64_t, int64_t, uint32_t
from cpython.mem cimport PyMem_Malloc, PyMem_Calloc, PyMem_Free

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #define TH_SEED 0x9E3779B97F4A7C15ULL
    static inline uint64_t th_mix(uint64_t z) {
        z ^= z >> 30; z *= 0xBF58476D1CE4E5B9ULL;
        z ^= z >> 27; z *= 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }
    /* buf(): the caller passes h = start(tag). Words are read little-endian on every host. */
    static uint64_t th_hash_buf(uint64_t h, const unsigned char *p, size_t n) {
        size_t len = n, i;
        uint64_t w;
        for (; n >= 8; p += 8, n -= 8) {
            memcpy(&w, p, 8);
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
            w = __builtin_bswap64(w);
    #endif
            h = th_mix(h ^ w);
        }
        if (n) {
            w = 0;
            for (i = 0; i < n; i++) w |= (uint64_t)p[i] << (8 * i);
            h = th_mix(h ^ w);
        }
        return th_mix(h ^ (uint64_t)len);
    }
    static inline uint64_t th_double_bits(double d) {
        uint64_t w;
        if (d != d) return 0x7FF8000000000000ULL;   /* one NaN */
        if (d == 0.0) d = 0.0;                      /* -0.0 == 0.0 */
        memcpy(&w, &d, 8);
        return w;
    }
    """
    const uint64_t TH_SEED
    uint64_t th_mix(uint64_t z) nogil
    uint64_t th_hash_buf(uint64_t h, const unsigned char *p, size_t n) nogil
    uint64_t th_double_bits(double d) nogil

# Borrowed-reference C-API, declared here so the hot loops need no refcounting.
cdef extern from "Python.h":
    ctypedef struct PyObject
    ctypedef struct PyTypeObject
    ctypedef struct Py_buffer:
        void *buf
        Py_ssize_t len
    bint PyLong_CheckExact(PyObject *o)
    bint PyLong_Check(PyObject *o)
    bint PyUnicode_CheckExact(PyObject *o)
    bint PyUnicode_Check(PyObject *o)
    int PyUnicode_READY(PyObject *o) except -1  # a no-op since 3.12
    bint PyUnicode_IS_ASCII(PyObject *o)
    void *PyUnicode_DATA(PyObject *o)
    Py_ssize_t PyUnicode_GET_LENGTH(PyObject *o)
    const char *PyUnicode_AsUTF8AndSize(PyObject *o, Py_ssize_t *size)  # NULL + error on surrogates
    bint PyTuple_Check(PyObject *o)
    bint PyList_Check(PyObject *o)
    bint PyFloat_Check(PyObject *o)
    double PyFloat_AS_DOUBLE(PyObject *o)
    bint PyBytes_Check(PyObject *o)
    char *PyBytes_AS_STRING(PyObject *o)
    Py_ssize_t PyBytes_GET_SIZE(PyObject *o)
    bint PyByteArray_Check(PyObject *o)
    bint PyMemoryView_Check(PyObject *o)
    Py_ssize_t PySequence_Fast_GET_SIZE(PyObject *o)
    PyObject *PySequence_Fast_GET_ITEM(PyObject *o, Py_ssize_t i)
    PyObject **PySequence_Fast_ITEMS(PyObject *o)
    PyObject *PyTuple_GET_ITEM(PyObject *o, Py_ssize_t i)
    Py_ssize_t PyTuple_GET_SIZE(PyObject *o)
    PyObject *PyList_GET_ITEM(PyObject *o, Py_ssize_t i)
    Py_ssize_t PyList_GET_SIZE(PyObject *o)
    void PyList_SET_ITEM(object o, Py_ssize_t i, PyObject *v)
    object PyList_New(Py_ssize_t n)
    PyObject *PyLong_FromUnsignedLong(unsigned long v)  # new reference, NULL on error
    long long PyLong_AsLongLongAndOverflow(PyObject *o, int *overflow) except? -1
    int PyObject_GetBuffer(PyObject *o, Py_buffer *view, int flags) except -1
    void PyBuffer_Release(Py_buffer *view)
    int PyBUF_SIMPLE
    PyObject *Py_None
    void Py_INCREF(PyObject *o)
    void Py_DECREF(PyObject *o)
    void PyErr_Clear()
    int Py_EnterRecursiveCall(const char *where) except 1  # returns 1 (with RecursionError set)
    void Py_LeaveRecursiveCall()

cdef enum:
    TAG_NONE = 1
    TAG_INT = 2
    TAG_BIGINT = 3
    TAG_FLOAT = 4
    TAG_STR = 5
    TAG_BYTES = 6
    TAG_SEQ = 7

cdef uint64_t START_NONE = th_mix(TH_SEED ^ TAG_NONE)
cdef uint64_t START_INT = th_mix(TH_SEED ^ TAG_INT)
cdef uint64_t START_BIGINT = th_mix(TH_SEED ^ TAG_BIGINT)
cdef uint64_t START_FLOAT = th_mix(TH_SEED ^ TAG_FLOAT)
cdef uint64_t START_STR = th_mix(TH_SEED ^ TAG_STR)
cdef uint64_t START_BYTES = th_mix(TH_SEED ^ TAG_BYTES)
cdef uint64_t START_SEQ = th_mix(TH_SEED ^ TAG_SEQ)

MAX_BIN_BITS = 16  # bins_of / route_bins accept k in 0..MAX_BIN_BITS

# For the annotations only (annotation_typing=False: Cython does not enforce them).
from collections.abc import Callable, Sequence
from typing import Any, Union
Key = Union[int, None, Callable[[Any], Any]]


# ---------------------------------------------------------------------------------------------
# The hash of one object
# ---------------------------------------------------------------------------------------------

cdef uint64_t _hash_slow(object obj) except? 0:
    """The rare cases: big ints, str with lone surrogates, non-contiguous memoryviews."""
    cdef bytes b
    if isinstance(obj, int):
        n = (int.bit_length(obj) + 64) // 64
        b = int.to_bytes(obj, 8 * n, "little", signed=True)
        return th_hash_buf(START_BIGINT, <const unsigned char *>PyBytes_AS_STRING(<PyObject *>b),
                           <size_t>PyBytes_GET_SIZE(<PyObject *>b))
    if isinstance(obj, str):
        b = str.encode(obj, "utf-8", "surrogatepass")
        return th_hash_buf(START_STR, <const unsigned char *>PyBytes_AS_STRING(<PyObject *>b),
                           <size_t>PyBytes_GET_SIZE(<PyObject *>b))
    b = bytes(obj)  # memoryview.tobytes() semantics: the C-order bytes of the view
    return th_hash_buf(START_BYTES, <const unsigned char *>PyBytes_AS_STRING(<PyObject *>b),
                       <size_t>PyBytes_GET_SIZE(<PyObject *>b))


cdef int _unsupported(PyObject *o) except -1:
    t = type(<object>o)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    raise TypeError(
        f"hash64: unsupported key type {name!r} (supported: int, bool, float, None, str, bytes, "
        f"bytearray, memoryview, and tuples/lists of these)")


cdef int _hash(PyObject *o, uint64_t *out) except -1:
    """Store hash64(o) in *out. Runs no user code, so borrowed references stay valid."""
    cdef int overflow = 0
    cdef long long v
    cdef Py_ssize_t n, i
    cdef uint64_t h, sub
    cdef const char *s
    cdef PyObject *item
    cdef Py_buffer view
    if PyLong_CheckExact(o) or PyLong_Check(o):
        v = PyLong_AsLongLongAndOverflow(o, &overflow)
        if overflow == 0:
            out[0] = th_mix(START_INT ^ <uint64_t>v)
        else:
            out[0] = _hash_slow(<object>o)
        return 0
    if PyUnicode_CheckExact(o) or PyUnicode_Check(o):
        PyUnicode_READY(o)
        if PyUnicode_IS_ASCII(o):  # ASCII text is its own UTF-8
            out[0] = th_hash_buf(START_STR, <const unsigned char *>PyUnicode_DATA(o),
                                 <size_t>PyUnicode_GET_LENGTH(o))
            return 0
        s = PyUnicode_AsUTF8AndSize(o, &n)  # cached on the str object by CPython
        if s == NULL:                       # lone surrogates: hash the surrogatepass encoding
            PyErr_Clear()
            out[0] = _hash_slow(<object>o)
        else:
            out[0] = th_hash_buf(START_STR, <const unsigned char *>s, <size_t>n)
        return 0
    if PyTuple_Check(o) or PyList_Check(o):
        Py_EnterRecursiveCall(" while computing hash64 of a nested tuple/list")
        try:
            h = START_SEQ
            i = 0
            # Re-read the size each step and hold a reference to each item of a list: a list is
            # mutable, and hashing a big int or a memoryview allocates (a GC pass may run __del__).
            while i < PySequence_Fast_GET_SIZE(o):
                item = PySequence_Fast_GET_ITEM(o, i)
                Py_INCREF(item)
                try:
                    _hash(item, &sub)
                finally:
                    Py_DECREF(item)
                h = th_mix(h ^ sub)
                i += 1
            out[0] = th_mix(h ^ <uint64_t>i)
        finally:
            Py_LeaveRecursiveCall()
        return 0
    if PyFloat_Check(o):
        out[0] = th_mix(START_FLOAT ^ th_double_bits(PyFloat_AS_DOUBLE(o)))
        return 0
    if o == Py_None:
        out[0] = th_mix(START_NONE ^ 0)
        return 0
    if PyBytes_Check(o):
        out[0] = th_hash_buf(START_BYTES, <const unsigned char *>PyBytes_AS_STRING(o),
                             <size_t>PyBytes_GET_SIZE(o))
        return 0
    if PyByteArray_Check(o) or PyMemoryView_Check(o):
        try:
            PyObject_GetBuffer(o, &view, PyBUF_SIMPLE)
        except BufferError:  # a non-contiguous memoryview
            out[0] = _hash_slow(<object>o)
            return 0
        out[0] = th_hash_buf(START_BYTES, <const unsigned char *>view.buf, <size_t>view.len)
        PyBuffer_Release(&view)
        return 0
    return _unsupported(o)


def hash64(obj: object) -> int:
    """Deterministic unsigned 64-bit hash of ``obj`` (see the module docstring for the definition).

    Identical in every process and run. Supports int (any size), bool, None, float, str,
    bytes/bytearray/memoryview, and tuples/lists of these, nested. Other types raise TypeError.
    """
    cdef uint64_t h
    _hash(<PyObject *>obj, &h)
    return h


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
                    if PyTuple_Check(rec):
                        size = PyTuple_GET_SIZE(rec)
                        j = field if field >= 0 else field + size
                        if j < 0 or j >= size:
                            raise IndexError(f"field index {field} out of range for a record of {size} fields")
                        _hash(PyTuple_GET_ITEM(rec, j), &out[i])
                    elif PyList_Check(rec):
                        size = PyList_GET_SIZE(rec)
                        j = field if field >= 0 else field + size
                        if j < 0 or j >= size:
                            raise IndexError(f"field index {field} out of range for a record of {size} fields")
                        _hash(PyList_GET_ITEM(rec, j), &out[i])
                    else:
                        raise TypeError(f"an int key needs tuple or list records, not {type(<object>rec).__qualname__}")
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


def bins_of(records: Sequence, key: Key, k: int) -> list[int]:
    """Megaphone bin of each record: the top ``k`` bits of its key's hash64, ``hash >> (64 - k)``,
    for k in 0..16 (k == 0 puts every record in bin 0)."""
    cdef int bits = _check_k(k)
    cdef Py_ssize_t n, i
    seq = _as_batch(records)
    n = len(seq)
    cdef uint64_t *h = _alloc_words(n)
    try:
        _key_hashes(seq, key, h, NULL)
        if bits == 0:  # a shift by 64 is undefined in C
            return [0] * n
        return [h[i] >> (64 - bits) for i in range(n)]
    finally:
        PyMem_Free(h)


# Routing tables: any 1-D sequence of ints. Native-endian integer buffers (array.array, bytes,
# numpy) are read in place; other sequences (list, tuple, ...) item by item through the C-API.
cdef struct Table:
    const char *buf   # the buffer's items, if itemsize != 0
    Py_ssize_t itemsize  # 0: read seq instead
    bint signed_
    PyObject *seq     # a list or tuple, kept alive by the caller
    Py_ssize_t length


cdef object _open_table(object routing, Table *tb, Py_buffer *view):
    """Fill *tb for reading `routing`. Returns the object tb.seq borrows from, or, for a buffer,
    None with *view acquired (the caller releases it; it also locks a bytearray's size)."""
    cdef memoryview mv
    tb.buf = NULL
    tb.itemsize = 0
    tb.signed_ = False
    if isinstance(routing, (list, tuple)):
        table = routing
    else:
        try:
            mv = memoryview(routing)
        except TypeError:
            table = tuple(routing)
        else:
            if mv.ndim != 1:
                raise ValueError(f"routing table must be one-dimensional, got {mv.ndim} dimensions")
            fmt = mv.format.lstrip("@=")  # native byte order only: "<i" etc. go the generic way
            fast = (mv.c_contiguous and len(fmt) == 1 and fmt in "bBhHiIlLqQnN"
                    and mv.itemsize in (1, 2, 4, 8))
            table = None if fast else tuple(mv.tolist())
            itemsize = mv.itemsize
            mv.release()
            if fast:
                PyObject_GetBuffer(<PyObject *>routing, view, PyBUF_SIMPLE)
                tb.buf = <const char *>view.buf
                tb.itemsize = itemsize
                tb.signed_ = fmt in "bhilqn"
                tb.length = view.len // itemsize
                return None
    tb.seq = <PyObject *>table
    tb.length = len(table)
    return table


cdef int64_t _table_get(Table *tb, Py_ssize_t b) except? -1:
    """routing[b] as an int64 (-1 if it does not fit); the caller checks it is a worker index."""
    cdef const char *p
    cdef int overflow = 0
    cdef long long v
    if tb.itemsize:
        p = tb.buf + b * tb.itemsize
        if tb.itemsize == 1:
            return (<const signed char *>p)[0] if tb.signed_ else (<const unsigned char *>p)[0]
        if tb.itemsize == 2:
            return (<const short *>p)[0] if tb.signed_ else (<const unsigned short *>p)[0]
        if tb.itemsize == 4:
            return (<const int *>p)[0] if tb.signed_ else (<const unsigned int *>p)[0]
        # 8 bytes: unsigned values >= 2**63 turn negative and fail the range check, as they should
        return (<const long long *>p)[0]
    item = PySequence_Fast_GET_ITEM(tb.seq, b)
    if not PyLong_Check(item):
        raise ValueError(f"routing[{b}] is {_record_repr(<object>item)}, not an int worker index")
    v = PyLong_AsLongLongAndOverflow(item, &overflow)
    return -1 if overflow else v


def route_bins(records: Sequence, key: Key, k: int, routing: Sequence[int] | bytes,
               peers: int) -> tuple[list[list], list[list[int]]]:
    """Route a batch through a Megaphone routing table.

    bin = top ``k`` bits of the key's hash64 (as :func:`bins_of`); worker = ``routing[bin]``.
    ``routing`` has exactly ``2**k`` entries (a list/tuple of ints, or a 1-D integer buffer such
    as ``array.array`` or ``bytes``). Returns ``(records_per_worker, bins_per_worker)``: two lists
    of ``peers`` lists, parallel to each other, record order preserved. The table's length is always
    checked; an entry is checked (0 <= worker < peers, else ValueError) when a record uses it, so
    a table should be validated in full where it is installed.
    """
    cdef int bits = _check_k(k)
    cdef Py_ssize_t P = _check_peers(peers), n, i, nbins = (<Py_ssize_t>1) << bits
    cdef Table tb
    cdef int64_t w
    cdef uint32_t b
    cdef Py_buffer view
    cdef bint have_view = False
    cdef uint32_t *memo = NULL
    if len(routing) != nbins:
        raise ValueError(f"routing table has {len(routing)} entries, expected 2**k = {nbins} (k={bits})")
    seq = _as_batch(records)
    n = len(seq)
    cdef uint64_t *h = _alloc_words(2 * n)          # n hashes, then n record references
    cdef PyObject **refs = <PyObject **>(h + n)
    # The hash area is then reused: bins[i] overwrites bytes 4i..4i+3 (h[i] is read first, and
    # h[j] for j > i starts at 8j >= 4i + 8, so ascending i is safe); workers[i] takes the upper
    # half once every hash has been read.
    cdef uint32_t *bins = <uint32_t *>h
    cdef uint32_t *workers = bins + n
    try:
        table = _open_table(routing, &tb, &view)
        have_view = table is None
        if tb.length != nbins:
            raise ValueError(f"routing table has {tb.length} items, expected 2**k = {nbins} (k={bits})")
        _key_hashes(seq, key, h, refs)  # from here we own n references until _scatter takes them
        try:
            # Only a list table can change size (a key callable could do it); buffers are locked.
            if not have_view and PySequence_Fast_GET_SIZE(tb.seq) != nbins:
                raise RuntimeError("the routing table was modified while it was in use")
            for i in range(n):
                # TOP bits: bin b at k bits is the union of bins 2b and 2b+1 at k+1 bits.
                bins[i] = <uint32_t>(h[i] >> (64 - bits)) if bits else 0
            # memo[b] = routing[b] + 1 once bin b has been looked up and checked, 0 before.
            memo = <uint32_t *>PyMem_Calloc(nbins, sizeof(uint32_t))
            if memo == NULL:
                raise MemoryError()
            for i in range(n):
                b = bins[i]
                if memo[b] == 0:
                    w = _table_get(&tb, b)
                    if w < 0 or w >= P:
                        raise ValueError(f"routing[{b}] = {_table_value(routing, b)} is not a worker "
                                         f"index in 0..{P - 1} (peers={P})")
                    memo[b] = <uint32_t>w + 1
                workers[i] = memo[b] - 1
        except BaseException:
            _release(refs, n)
            raise
        return _scatter(refs, n, workers, P, bins)
    finally:
        PyMem_Free(h)
        PyMem_Free(memo)
        if have_view:
            PyBuffer_Release(&view)


cdef object _table_value(routing, Py_ssize_t b):
    try:
        return repr(routing[b])
    except Exception:
        return "?"
