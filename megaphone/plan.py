"""Migration planning: turn a routing-table change into a sequence of steps.

A routing table maps each bin to a worker (``table[b]`` is the owner of bin ``b``). A *plan* from
``current`` to ``target`` is a list of steps, each a ``{bin: worker}`` dict of moves issued together
over the control input (one timestamp); a controller issues the next step only once the previous one
has completed (ARCHITECTURE.md 5.6). Strategies (Megaphone paper, sections 3.3 and 4.4):

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

from .table import moved_bins, validate_table

__all__ = ["STRATEGIES", "Step", "plan"]

STRATEGIES = ("all_at_once", "fluid", "batched")

Step = dict[int, int]  # {bin: worker}: moves issued together at one control time


def plan(current: Sequence[int], target: Sequence[int], strategy: str = "batched",
         peers: int | None = None) -> list[Step]:
    """The steps (``{bin: worker}`` dicts) that turn routing table ``current`` into ``target``.

    Only bins whose worker changes move, each exactly once. ``strategy`` is ``"all_at_once"``,
    ``"fluid"`` or ``"batched"`` (see the module documentation). ``peers``, if given, is the number
    of workers (every worker in both tables must be below it). Raises :class:`ValueError` for an
    unknown strategy, :class:`~megaphone.table.TableError` for tables of different lengths or
    workers that do not exist.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown migration strategy {strategy!r} (expected one of {', '.join(STRATEGIES)})")
    current = validate_table(current, None, peers, "current")
    target = validate_table(target, len(current), peers, "target")
    changed = moved_bins(current, target)
    if not changed:
        return []
    if strategy == "all_at_once":
        return [{b: target[b] for b in changed}]
    if strategy == "fluid":
        return [{b: target[b]} for b in changed]
    return _batched(current, target, changed)


def prepare() -> None:
    """Import what planning needs now (a :class:`~megaphone.Controller` calls it when built): the
    first ``batched`` plan would otherwise stall its worker for the import, mid-run."""
    import networkx  # noqa: F401


def _batched(current: Sequence[int], target: Sequence[int], changed: list[int]) -> list[Step]:
    # Imported here, not with the module: networkx takes a tenth of a second or more to import,
    # which every worker of a Megaphone job would pay at start-up; only planning uses it (and
    # the controller imports it when built: prepare()).
    import networkx as nx
    from networkx.algorithms.bipartite import hopcroft_karp_matching

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
        pad = min(s_def[0][1], r_def[0][1])
        e = (s_def[0][0], r_def[0][0])
        mult[e] = mult.get(e, 0) + pad
        s_def[0][1] -= pad
        r_def[0][1] -= pad

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
                pending = real.get((s, r)) if e[0][0] == "s" and rk == "r" else None  # None: a dummy edge
                if pending:
                    step[pending.popleft()] = r
            if step:
                steps.append(step)
        for e in edges:
            mult[e] -= repeat
        remaining -= repeat
    return steps
