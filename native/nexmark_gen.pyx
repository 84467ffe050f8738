# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, annotation_typing=False
"""The NEXMark event generator in C (built as ``nexmark.nexmark_gen``).

Computes exactly what the numpy generator in ``nexmark/generator.py`` computes (same hashes, same
draws, same tuples), event by event, building the tuples directly instead of going through numpy
columns and ``tolist()``. ``nexmark.generator`` uses it when it is built and checks agreement in
the tests.
"""
from libc.stdint cimport uint64_t, int64_t
from libc.math cimport pow, rint
from cpython.list cimport PyList_New, PyList_Append
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.long cimport PyLong_FromLongLong
from cpython.ref cimport Py_INCREF

cdef uint64_t GOLDEN = 0x9E3779B97F4A7C15ULL


cdef inline uint64_t mix(uint64_t z) nogil:
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9ULL
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline uint64_t hash_j(uint64_t base, int j) nogil:
    return mix(base + <uint64_t>(j + 1) * GOLDEN)


cdef inline int64_t below(uint64_t h, int64_t k) nogil:
    return <int64_t>(h % <uint64_t>k)


cdef inline int64_t price(uint64_t h) nogil:
    cdef double u = <double>(h >> 11) * (1.0 / 9007199254740992.0)
    return <int64_t>rint(pow(10.0, u * 6.0) * 100.0)


cdef inline object _int(int64_t v):
    return PyLong_FromLongLong(v)


cdef inline void _set(tuple t, Py_ssize_t i, object v):
    Py_INCREF(v)
    PyTuple_SET_ITEM(t, i, v)


cdef class Native:
    """Generator state: the configuration (ints) and the string pools (lists of str)."""

    cdef int64_t rate, d, seed, active_people, in_flight, hs_ratio, ha_ratio, hb_ratio, hr2
    cdef int64_t num_cat, first_cat, first_person, first_auction, person_lead, auction_lead
    cdef int64_t P, A, D
    cdef uint64_t key
    cdef list names, emails, cards, items, descs, cities, states

    def __init__(self, tuple cfg, list names, list emails, list cards, list items, list descs,
                 list cities, list states):
        (self.rate, self.d, self.seed, self.active_people, self.in_flight, self.hs_ratio, self.ha_ratio,
         self.hb_ratio, self.hr2, self.num_cat, self.first_cat, self.first_person, self.first_auction,
         self.person_lead, self.auction_lead, self.P, self.A, self.D) = cfg
        self.key = mix(<uint64_t>(self.seed & 0xFFFFFFFFFFFFFFFF))
        self.names, self.emails, self.cards = names, emails, cards
        self.items, self.descs, self.cities, self.states = items, descs, cities, states

    cdef inline int64_t date_time(self, int64_t n):
        return (n * (1000 * self.d)) // self.rate

    cdef inline int64_t last_person(self, int64_t n):
        cdef int64_t off = n % self.D
        if off > self.P - 1:
            off = self.P - 1
        return (n // self.D) * self.P + off

    cdef inline int64_t last_auction(self, int64_t n):
        cdef int64_t epoch = n // self.D
        cdef int64_t off = n % self.D
        if off < self.P:
            epoch -= 1
            off = self.A - 1
        elif off >= self.P + self.A:
            off = self.A - 1
        else:
            off -= self.P
        return epoch * self.A + off

    cdef inline int64_t next_person(self, int64_t n, uint64_t h):
        cdef int64_t people = self.last_person(n) + 1
        cdef int64_t active = people if people < self.active_people else self.active_people
        return people - active + below(h, active + self.person_lead)

    cdef inline int64_t next_auction(self, int64_t n, uint64_t h):
        cdef int64_t hi = self.last_auction(n)
        cdef int64_t lo = hi - self.in_flight
        if lo < 0:
            lo = 0
        return lo + below(h, hi - lo + 1 + self.auction_lead)

    def generate(self, int64_t lo, int64_t hi, int64_t index, int64_t peers):
        """``(persons, auctions, bids)``: the events ``lo <= n < hi`` with ``n % peers == index``."""
        cdef list persons = [], auctions = [], bids = []
        cdef int64_t n, rem, dt, initial, seller, horizon, ahead, x
        cdef uint64_t base, h0, h1, h2, h3
        cdef tuple t
        cdef int64_t pool = len(self.emails)
        cdef int64_t n_names = len(self.names), n_cities = len(self.cities), n_states = len(self.states)
        ahead = (self.in_flight * self.D) // self.A
        n = lo + ((index - lo) % peers + peers) % peers
        while n < hi:
            rem = n % self.D
            base = mix((<uint64_t>n) * GOLDEN ^ self.key)
            dt = self.date_time(n)
            if rem < self.P:
                h0 = hash_j(base, 0)
                h1 = hash_j(base, 1)
                t = PyTuple_New(7)
                _set(t, 0, _int(self.last_person(n) + self.first_person))
                _set(t, 1, self.names[below(h0, n_names)])
                _set(t, 2, self.emails[below(h0 >> 20, pool)])
                _set(t, 3, self.cards[below(h0 >> 40, pool)])
                _set(t, 4, self.cities[below(h1, n_cities)])
                _set(t, 5, self.states[below(h1 >> 20, n_states)])
                _set(t, 6, _int(dt))
                PyList_Append(persons, t)
            elif rem < self.P + self.A:
                h0 = hash_j(base, 0)
                h1 = hash_j(base, 1)
                h2 = hash_j(base, 2)
                h3 = hash_j(base, 3)
                initial = price(h0)
                if below(h2, self.hs_ratio) > 0:
                    seller = (self.last_person(n) // self.hr2) * self.hr2
                else:
                    seller = self.next_person(n, h2 >> 8)
                horizon = self.date_time(n + ahead) - dt
                x = horizon * 2
                if x < 1:
                    x = 1
                t = PyTuple_New(9)
                _set(t, 0, _int(self.last_auction(n) + self.first_auction))
                _set(t, 1, self.items[below(h2 >> 40, pool)])
                _set(t, 2, self.descs[below(h3 >> 48, pool)])
                _set(t, 3, _int(initial))
                _set(t, 4, _int(initial + price(h1)))
                _set(t, 5, _int(dt))
                _set(t, 6, _int(dt + 1 + below(h3 >> 8, x)))
                _set(t, 7, _int(seller + self.first_person))
                _set(t, 8, _int(self.first_cat + below(h3, self.num_cat)))
                PyList_Append(auctions, t)
            else:
                h0 = hash_j(base, 0)
                h1 = hash_j(base, 1)
                t = PyTuple_New(4)
                if below(h0, self.ha_ratio) > 0:
                    x = (self.last_auction(n) // self.hr2) * self.hr2
                else:
                    x = self.next_auction(n, h0 >> 16)
                _set(t, 0, _int(x + self.first_auction))
                if below(h0 >> 8, self.hb_ratio) > 0:
                    x = (self.last_person(n) // self.hr2) * self.hr2 + 1
                else:
                    x = self.next_person(n, h0 >> 32)
                _set(t, 1, _int(x + self.first_person))
                _set(t, 2, _int(price(h1)))
                _set(t, 3, _int(dt))
                PyList_Append(bids, t)
            n += peers
        return persons, auctions, bids
