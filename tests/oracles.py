"""Sequential per-epoch oracles for the dataflow tests, and the multisets they are compared with.

Results come back from every worker (through msgpack when workers > 1: lists arrive as tuples,
hence ``norm``) and are compared per worker where the placement is defined (pipeline, exchange by
hash, broadcast), or merged over the workers otherwise. Exchange keys are module-level functions:
they exist before the cluster forks, so they are the same object in every worker.
"""
from __future__ import annotations

from collections import Counter

from conftest import norm

from timely.routing import hash64


def timed(extracted) -> Counter:
    """A capture's ``extract()`` (possibly msgpack round-tripped) as a multiset of (time, record)."""
    return Counter((norm(t), norm(r)) for t, recs in extracted for r in recs)


def merged(results, i=None) -> Counter:
    """:func:`timed` summed over the workers' results (of each result's ``i``-th item if given)."""
    total: Counter = Counter()
    for res in results:
        total += timed(res if i is None else res[i])
    return total


def per_worker_oracle(epochs, w, peers, f) -> Counter:
    """(time, output) multiset for worker ``w`` of a pipeline operator: ``f`` maps a slice to outputs."""
    return Counter((t, norm(y)) for t, recs in epochs for y in f(recs[w::peers]))


def sliced_pair_oracle(epochs, w, peers, f) -> Counter:
    """Like :func:`per_worker_oracle` for two inputs: ``f`` maps ``(slice1, slice2)`` to outputs."""
    return Counter((t, norm(y)) for t, (ra, rb) in epochs for y in f((ra[w::peers], rb[w::peers])))


def global_oracle(epochs, f) -> Counter:
    """(time, output) multiset when ``f`` maps a whole epoch to its outputs."""
    return Counter((t, norm(y)) for t, recs in epochs for y in f(recs))


def hash_worker(key, peers):
    """The worker an exchange by ``key`` sends a record to (README: ``hash64(key) % peers``)."""
    return hash64(key) % peers


def to_zero(record):
    """Exchange key sending every record to one worker, ``hash_worker(0, peers)``."""
    return 0


def first_field(record):
    """Exchange key: the record's first field."""
    return record[0]
