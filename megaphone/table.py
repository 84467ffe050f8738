"""Routing tables: which worker owns each bin, and the control records that change them.

Keyed state lives in ``nbins = 2**k`` bins: ``k`` is always the exponent (0 to :data:`MAX_K`),
``nbins`` always the count. A *routing table* is a tuple with one worker index per bin
(``table[b]`` owns bin ``b``). Configuration updates, the records of the control stream, change it
from a time on:

* ``("move", bin, worker)``: bin ``bin`` moves to ``worker``;
* ``("table", (w_0, ..., w_{nbins-1}))``: a whole new table;
* ``("precopy", bin, worker)``: no change of the table; the owner of ``bin`` starts copying it to
  ``worker`` ahead of a later move (:mod:`megaphone.precopy`);
* ``("replica", bin, worker)``: the same copy, kept on ``worker`` as a standby replica and
  refreshed until the bin moves (:mod:`megaphone.precopy`).

Every check that a bin, a worker or a table exists and fits the configuration is made here and
raises :class:`TableError`. Bins and workers are integers: Python's, or any other
:class:`numbers.Integral` (numpy's ``int64`` and the like), which the checks return as ``int``;
booleans are refused.
"""
from __future__ import annotations

import numbers
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from timely.errors import TimelyError

MAX_K = 16  # at most 2^16 bins

Table = tuple[int, ...]
Update = tuple[Any, ...]  # ("move" | "precopy" | "replica", bin, worker) or ("table", Table)
#: The control records that copy a bin and change no table.
COPIES = ("precopy", "replica")


class TableError(TimelyError, ValueError):
    """A bin, worker, routing table or control record that does not fit the configuration: a bin or
    worker that does not exist, a table of the wrong length, a malformed control record."""


def validate_k(k: Any) -> int:
    """Return ``k`` if it is a valid exponent (``2**k`` bins, ``0 <= k <= MAX_K``); raise
    :class:`TableError` otherwise."""
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_K:
        raise TableError(f"k is the exponent of 2^k bins, an integer from 0 to {MAX_K}, not {k!r}")
    return k


def _is_int(x: Any) -> bool:
    """True for an integer (an ``int`` or a numpy integer, any :class:`numbers.Integral`) that is
    not a boolean."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _problem(index: Any, count: int | None, noun: str) -> str | None:
    """Why ``index`` is not one of ``count`` ``noun``s numbered from 0 (any non-negative integer if
    ``count`` is None), or None if it is one."""
    if not _is_int(index):
        return f"{noun} {index!r} is not an integer"
    if index < 0:
        return f"{noun} {index} does not exist ({noun}s are numbered from 0)"
    if count is not None and index >= count:
        return f"{noun} {index} does not exist (there are {count} {noun}s)"
    return None


def validate_move(bin: Any, worker: Any, nbins: int, peers: int) -> tuple[int, int]:
    """``(bin, worker)`` as ints, once checked that ``bin`` is one of ``nbins`` bins and ``worker``
    one of ``peers`` workers; raises :class:`TableError` otherwise."""
    problem = _problem(bin, nbins, "bin") or _problem(worker, peers, "worker")
    if problem:
        raise TableError(f"move of bin {bin!r} to worker {worker!r}: {problem}")
    return int(bin), int(worker)


def validate_table(table: Any, nbins: int | None = None, peers: int | None = None, what: str = "routing") -> Table:
    """``table`` as a tuple of ints, once checked: a sequence (or one-dimensional numpy array) of
    worker indices, ``nbins`` of them if given, each below ``peers`` if given. Raises
    :class:`TableError`; ``what`` names the table in it."""
    if not (isinstance(table, Sequence) or getattr(table, "ndim", None) == 1) or isinstance(table, (str, bytes)):
        expected = f"{nbins} workers" if nbins is not None else "workers"
        raise TableError(f"{what} table must be a sequence of {expected}, one per bin, "
                         f"not {type(table).__name__} {table!r:.60}")
    if nbins is not None and len(table) != nbins:
        raise TableError(f"{what} table has {len(table)} entries, expected one per bin ({nbins})")
    for b, w in enumerate(table):
        problem = _problem(w, peers, "worker")
        if problem:
            raise TableError(f"{what} table, bin {b}: {problem}")
    return tuple(int(w) for w in table)


def validate_update(update: Any, nbins: int, peers: int) -> Update:
    """``update`` as a control record of ints (see the module documentation), once checked that it
    is one and that its bins and workers exist; raises :class:`TableError` otherwise."""
    if isinstance(update, (tuple, list)) and len(update) == 3 and update[0] in ("move", *COPIES):
        return (update[0], *validate_move(update[1], update[2], nbins, peers))
    if isinstance(update, (tuple, list)) and len(update) == 2 and update[0] == "table":
        return ("table", validate_table(update[1], nbins, peers))
    raise TableError(f"control record {update!r:.200} is not ('move' | 'precopy' | 'replica', bin, worker) or "
                     "('table', (worker per bin...))")


def rebalance_kind(req: Mapping[str, Any], error: type[Exception] = ValueError) -> str:
    """Which of ``"table"``, ``"balanced"`` or ``"moves"`` a rebalance request (the control
    endpoint's, the dashboard's) asks for; ``error`` (naming the problem) unless exactly one, or for a
    ``balanced`` that is not a bool (``"no"`` read as true)."""
    if req.get("balanced") is not None and not isinstance(req["balanced"], bool):
        raise error(f"'balanced' must be true or false, not {req['balanced']!r:.60}")
    given = [key for key in ("table", "balanced", "moves") if req.get(key) not in (None, False)]
    if len(given) != 1:
        raise error("a rebalance request needs exactly one of 'table', 'balanced' or 'moves'")
    return given[0]


def move_updates(moves: Mapping[int, int]) -> list[Update]:
    """The control records of the ``{bin: worker}`` moves, in bin order."""
    return [("move", b, w) for b, w in sorted(moves.items())]


def canonical(updates: Iterable[Update]) -> list[Update]:
    """The updates of one time in the order a migratable operator applies them: whole tables first,
    then moves by bin and worker, whatever order they were sent or arrived in.

    Timely delivers the control records of one time in any order (split and interleaved
    differently on every worker), and every worker must compile the same table from them
    (ARCHITECTURE 5.1).
    """
    return sorted(updates, key=lambda u: (0, tuple(u[1])) if u[0] == "table" else (1, u[1], u[2]))


def apply(table: Sequence[int], updates: Iterable[Update]) -> Table:
    """The routing table after applying ``updates`` in order to ``table``.

    The updates must be valid (:func:`validate_update`): they are not checked again here.
    """
    new = list(table)
    for u in updates:
        if u[0] == "move":
            new[u[1]] = u[2]
        else:
            new = list(u[1])
    return tuple(new)


def balanced(nbins: int, peers: int) -> Table:
    """The round-robin table of ``nbins`` bins over ``peers`` workers (bin ``b`` on ``b % peers``):
    the table every migratable operator starts from."""
    if isinstance(peers, bool) or not isinstance(peers, int) or peers < 1:
        raise TableError(f"peers must be an integer of at least 1, not {peers!r}")
    if isinstance(nbins, bool) or not isinstance(nbins, int) or nbins < 0:
        raise TableError(f"nbins must be a non-negative integer, not {nbins!r}")
    return tuple(b % peers for b in range(nbins))


def skewed(current: Sequence[int], fraction: float = 0.5, peers: int | None = None) -> Table:
    """A skewed copy of ``current``: every odd worker ``2i+1`` gives the first ``fraction`` of its
    bins (in bin order) to worker ``2i``.

    Half of the workers give away half of their bins (by default) to the other half: from a
    round-robin table this is the paper's ``uniform`` -> ``uniform_skew`` pattern, moving a quarter
    of all bins, each donor to its own receiver (so a batched plan needs as many steps as one donor
    gives bins). ``peers`` defaults to one more than the largest worker in ``current``.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be between 0 and 1, not {fraction}")
    current = validate_table(current, None, peers, "current")
    if peers is None:
        peers = max(current, default=-1) + 1
    owned: dict[int, list[int]] = defaultdict(list)
    for b, w in enumerate(current):
        owned[w].append(b)
    new = list(current)
    for donor in range(1, peers, 2):
        bins = owned.get(donor, [])
        for b in bins[: int(round(len(bins) * fraction))]:
            new[b] = donor - 1
    return tuple(new)


def moved_bins(old: Sequence[int], new: Sequence[int], source: int | None = None) -> list[int]:
    """The bins whose worker differs between tables ``old`` and ``new``, ascending; with ``source``,
    only those that ``old`` places on worker ``source`` (the bins it gives away)."""
    if len(old) != len(new):
        raise TableError(f"the tables have different lengths ({len(old)} and {len(new)} bins)")
    return [b for b, (o, n) in enumerate(zip(old, new)) if o != n and (source is None or o == source)]
