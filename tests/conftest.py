"""Shared helpers for the dataflow tests: run a job on N workers, normalise results, size hypothesis.

Parametrize ids are ``w1``/``w2``/``w3``: ``pytest -k w1`` runs the single-worker cases only.
"""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings

import timely

WORKER_COUNTS = [1, 2, 3]
WORKER_IDS = [f"w{n}" for n in WORKER_COUNTS]


def run(main, workers: int) -> list:
    """``timely.execute(main, workers=workers)``: one result per worker, by index."""
    return timely.execute(main, workers=workers)


@pytest.fixture
def runner():
    return run


def norm(x):
    """Lists and tuples become tuples, recursively (results crossing processes come back as tuples)."""
    if isinstance(x, (list, tuple)):
        return tuple(norm(y) for y in x)
    return x


def bag(items) -> Counter:
    """A multiset of normalised items."""
    return Counter(norm(x) for x in items)


def examples(workers: int, single: int = 20, multi: int = 4):
    """Hypothesis settings: ``single`` examples in-process, few when every example forks workers."""
    return settings(
        max_examples=single if workers == 1 else multi,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
