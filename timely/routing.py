"""Deterministic routing of records to workers, backed by the Cython hashing module."""
from __future__ import annotations

from typing import Any

import msgpack

from ._native import hashing as _hashing

hash64 = _hashing.hash64
partition = _hashing.partition
bins_of = _hashing.bins_of
route_bins = _hashing.route_bins


def serialisable(record: Any) -> bool:
    """True when ``record`` can be sent to another worker (msgpack can encode it)."""
    try:
        msgpack.packb(record)
        return True
    except Exception:
        return False
