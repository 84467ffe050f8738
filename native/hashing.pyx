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

Anything else (dict, set, numpy scalars such as ``np.int64`` or ``np.float32``, ...) is a TypeError
naming the type; ``np.float64``, ``np.str_`` and ``np.bytes_`` are subclasses of float, str and bytes
and hash like them. Note that ``1`` and
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

Sources: this file (the hash), batch.pxi (partition, hash_batch, bins_of), route_bins.pxi
(route_bins) and columns.pxi (the same hash over Arrow columns, and splitting rows by worker, for
timely.columnar.kernels), included below into the one extension module.
"""
from libc.stdint cimport uint64_t, int64_t, uint32_t
import struct
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
    PyObject *PyList_GET_ITEM(PyObject *o, Py_ssize_t i)
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


include "batch.pxi"
include "route_bins.pxi"
include "columns.pxi"
