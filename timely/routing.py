"""Deterministic routing of records to workers, backed by the Cython hashing module.

``hash64`` is the hash every worker agrees on; ``partition``, ``bins_of`` and ``route_bins`` route
whole batches with it (``native/hashing.pyx`` defines all four exactly); ``add_keys`` collects the
keys of a batch's records per bin, and ``gather`` reads a dict's entries for a set of keys.
"""
from __future__ import annotations

from typing import Any

from ._native.hashing import add_keys, bins_of, gather, hash64, hash_batch, partition, route_bins

__all__ = ["add_keys", "bins_of", "gather", "hash64", "partition", "route_bins", "unroutable"]


def unroutable(batch: Any, key: Any) -> Any:
    """The first record of ``batch`` whose exchange key (``key`` as in ``partition``: a field
    index, a function, or ``None`` for the whole record) cannot be taken or hashed, to name it in
    an error (``None`` if every one can)."""
    for record in batch:
        try:
            hash_batch([record], key)  # the native rules themselves (a field index needs a tuple or list)
        except Exception:
            return record
    return None


