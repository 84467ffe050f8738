"""Migration planning: turn a routing-table change into a sequence of steps.

A routing table maps each bin to a worker (``table[b]`` is the owner of bin ``b``). A *plan* from
``current`` to ``target`` is a list of steps, each a ``{bin: worker}`` dict of moves issued together
over the control input (one timestamp); a controller issues the next step only once the previous one
has completed (DESIGN.md 5.6). Strategies (Megaphone paper, sections 3.3 and 4.4):

* ``"all_at_once"``: one step with every changed bin (the "partial pause-and-resume" of other
  systems);
* ``"fluid"``: one bin per step, in bin order;
* ``"batched"``: each step a matching in the graph sender-worker -> receiver-worker of the
  outstanding moves: every worker sends at most one bin and receives at most one bin per step.

Batched plans and the number of steps
-------------------------------------
The moves form a bipartite multigraph (a sender copy and a receiver copy of every worker, one edge
per moving bin). No plan of matchings can have fewer steps than its maximum degree
``D = max over workers of max(#bins it sends, #bins it receives)``, and by Koenig's edge-colouring
theorem ``D`` steps always suffice.

The reference implementation simply repeats a maximum matching of the outstanding moves. That does
*not* reach ``D`` in general: a maximum matching may leave a worker of maximum degree unmatched. With
moves ``0->3, 1->3, 1->4, 2->4`` (``D = 2``) the maximum matching ``{0->3, 2->4}`` leaves worker 1 with
two bins to send, so three steps follow. This module therefore first pads the multigraph with dummy
vertices and dummy edges until it is ``D``-regular; a maximum matching of a regular bipartite
multigraph is perfect, and removing it leaves a ``(D-1)``-regular one, so ``D`` repetitions of a
maximum matching (computed by networkx's Hopcroft-Karp, on the simple graph of edge multiplicities)
schedule every move. Each step carries the real moves of its matching; steps with only dummy edges
are dropped. A matching is repeated as long as all its edges still have multiplicity left, so two
workers exchanging 30,000 bins need one matching computation, not 30,000.
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

import networkx as nx
from networkx.algorithms.bipartite import hopcroft_karp_matching

STRATEGIES = ("all_at_once", "fluid", "batched")

Table = Sequence[int]
Step = dict[int, int]


def check_table(table: Table, what: str = "routing", peers: int | None = None) -> None:
    """Raise :class:`ValueError` unless every entry of ``table`` is a worker index (non-negative,
    and below ``peers`` if given); ``what`` names the table in the message."""
    for b, w in enumerate(table):
        if isinstance(w, bool) or not isinstance(w, int):
            raise ValueError(f"{what} table maps bin {b} to {w!r}, which is not a worker index")
        if w < 0:
            raise ValueError(f"{what} table maps bin {b} to worker {w}: workers cannot be negative")
        if peers is not None and w >= peers:
            raise ValueError(f"{what} table maps bin {b} to worker {w}, which does not exist ({peers} workers)")


def _check_pair(current: Table, target: Table, peers: int | None) -> None:
    if len(current) != len(target):
        raise ValueError(
            f"current and target tables have different lengths ({len(current)} and {len(target)} bins)"
        )
    check_table(current, "current", peers)
    check_table(target, "target", peers)


def moved_bins(current: Table, target: Table) -> list[int]:
    """The bins whose worker differs between ``current`` and ``target``, ascending."""
    if len(current) != len(target):
        raise ValueError(
            f"current and target tables have different lengths ({len(current)} and {len(target)} bins)"
        )
    return [b for b, (c, t) in enumerate(zip(current, target)) if c != t]


def plan(current: Table, target: Table, strategy: str = "batched", peers: int | None = None) -> list[Step]:
    """The steps (``{bin: worker}`` dicts) that turn routing table ``current`` into ``target``.

    Only bins whose worker changes move, each exactly once. ``strategy`` is ``"all_at_once"``,
    ``"fluid"`` or ``"batched"`` (see the module documentation). ``peers``, if given, is the number
    of workers (every worker in both tables must be below it). Raises :class:`ValueError` for an
    unknown strategy, tables of different lengths or invalid workers.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown migration strategy {strategy!r} (expected one of {', '.join(STRATEGIES)})")
    _check_pair(current, target, peers)
    changed = moved_bins(current, target)
    if not changed:
        return []
    if strategy == "all_at_once":
        return [{b: target[b] for b in changed}]
    if strategy == "fluid":
        return [{b: target[b]} for b in changed]
    return _batched(current, target, changed)


def _batched(current: Table, target: Table, changed: list[int]) -> list[Step]:
    # Outstanding moves per (sender, receiver) pair, in bin order.
    real: dict[tuple[int, int], deque[int]] = defaultdict(deque)
    for b in changed:
        real[current[b], target[b]].append(b)
    out_deg: dict[int, int] = defaultdict(int)
    in_deg: dict[int, int] = defaultdict(int)
    for (s, r), bins in real.items():
        out_deg[s] += len(bins)
        in_deg[r] += len(bins)
    degree = max(max(out_deg.values()), max(in_deg.values()))

    # Vertices: ("s", w) senders and ("r", w) receivers, padded with dummies to equal sides.
    senders = [("s", w) for w in sorted(out_deg)]
    receivers = [("r", w) for w in sorted(in_deg)]
    n = max(len(senders), len(receivers))
    senders += [("s*", i) for i in range(n - len(senders))]
    receivers += [("r*", i) for i in range(n - len(receivers))]
    mult: dict[tuple, int] = {(("s", s), ("r", r)): len(bins) for (s, r), bins in real.items()}

    # Pad with dummy edges until every vertex has degree `degree` (both sides miss the same total).
    def deficits(side: list, deg: dict) -> deque:
        return deque([v, degree - (deg.get(v[1], 0) if v[0] in ("s", "r") else 0)] for v in side)

    s_def = deficits(senders, out_deg)
    r_def = deficits(receivers, in_deg)
    while s_def and r_def:
        if s_def[0][1] == 0:
            s_def.popleft()
            continue
        if r_def[0][1] == 0:
            r_def.popleft()
            continue
        k = min(s_def[0][1], r_def[0][1])
        e = (s_def[0][0], r_def[0][0])
        mult[e] = mult.get(e, 0) + k
        s_def[0][1] -= k
        r_def[0][1] -= k

    steps: list[Step] = []
    remaining = degree
    while remaining:
        graph = nx.Graph()
        graph.add_nodes_from(senders, bipartite=0)
        graph.add_nodes_from(receivers, bipartite=1)
        graph.add_edges_from(e for e, m in mult.items() if m)
        matching = hopcroft_karp_matching(graph, top_nodes=senders)
        edges = [(s, matching[s]) for s in senders]  # perfect: the padded multigraph is regular
        repeat = min(mult[e] for e in edges)
        for _ in range(repeat):
            step: Step = {}
            for e in edges:
                (_, s), (rk, r) = e
                bins = real.get((s, r)) if e[0][0] == "s" and rk == "r" else None
                if bins:
                    step[bins.popleft()] = r
            if step:
                steps.append(step)
        for e in edges:
            mult[e] -= repeat
        remaining -= repeat
    return steps


def balanced(bins: int, peers: int) -> tuple[int, ...]:
    """The round-robin table of ``bins`` bins (a count, not the exponent k) over ``peers`` workers."""
    if peers < 1:
        raise ValueError(f"peers must be at least 1, not {peers}")
    if bins < 0:
        raise ValueError(f"bins cannot be negative ({bins})")
    return tuple(b % peers for b in range(bins))


def skewed(current: Table, fraction: float = 0.5, peers: int | None = None) -> tuple[int, ...]:
    """A skewed copy of ``current``: every odd worker ``2i+1`` gives the first ``fraction`` of its
    bins (in bin order) to worker ``2i``.

    Half of the workers give away half of their bins (by default) to the other half: from a
    round-robin table this is the paper's ``uniform`` -> ``uniform_skew`` pattern, moving a quarter
    of all bins, each donor to its own receiver (so a batched plan needs as many steps as one donor
    gives bins). ``peers`` defaults to one more than the largest worker in ``current``.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be between 0 and 1, not {fraction}")
    check_table(current, "current", peers)
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
