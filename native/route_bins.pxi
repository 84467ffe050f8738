# Included by hashing.pyx (one extension, timely._native.hashing), after batch.pxi: routing a
# batch through a Megaphone routing table.

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
            table = None
            if not fast:
                try:
                    table = tuple(mv.tolist())
                except NotImplementedError:  # an explicit byte order ("<q", ">i8"): tolist refuses it
                    table = tuple(v for (v,) in struct.iter_unpack(mv.format, mv.tobytes()))
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
