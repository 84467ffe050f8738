"""Hypothesis strategies for the ``Builder`` / ``Tracker`` tests: random graphs (with or without
well-formed cycles), rings through scope levels, and batches of pointstamp updates (positive and
negative, transiently negative counts allowed)."""
from __future__ import annotations

from hypothesis import strategies as st
from reachability import Graph

from timely.progress import Summary


@st.composite
def op_step(draw, depth: int, advancing: bool = False):
    """A depth-preserving operator step: a general (keep, add, push) summary."""
    keep = draw(st.integers(1, depth))
    add = draw(st.integers(1 if advancing else 0, 2))
    push = tuple(draw(st.lists(st.integers(0, 2), min_size=depth - keep, max_size=depth - keep)))
    return ("general", Summary(keep, add, push))


@st.composite
def node(draw, max_depth: int):
    kinds = ["op", "op", "feedback"]
    d = draw(st.integers(1, max_depth))
    if d < max_depth:
        kinds.append("enter")
    if d > 1:
        kinds.append("leave")
    kind = draw(st.sampled_from(kinds))
    if kind == "op":
        ins, outs = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        steps = [[draw(st.lists(op_step(d), max_size=2)) for _ in range(outs)] for _ in range(ins)]
        return kind, (d, d, ins, outs, steps)
    outs = draw(st.integers(1, 2))
    if kind == "feedback":
        step = ("feedback", draw(st.integers(1, 2)))
        dout = d
    elif kind == "enter":
        step, dout = ("enter", None), d + 1
    else:
        step, dout = ("leave", None), d - 1
    return kind, (d, dout, 1, outs, [[[step] for _ in range(outs)]])


def min_keep(spec) -> int:
    din, dout, ins, outs, steps = spec
    keeps = [din, dout]
    for row in steps:
        for cell in row:
            for kind, arg in cell:
                if kind == "general":
                    keeps.append(arg.keep)
    return min(keeps)


@st.composite
def graph(draw, max_depth: int, acyclic_only_through_feedback: bool, max_nodes: int = 6):
    """Random graph. With ``acyclic_only_through_feedback`` every cycle is well formed by construction:
    backward edges (to a node at or before the source) must enter a feedback node of depth d, and
    every node between them keeps at least d coordinates (so the cycle's lowest level is the feedback's).
    """
    kinds_specs = draw(st.lists(node(max_depth), min_size=1, max_size=max_nodes))
    kinds = [k for k, _ in kinds_specs]
    nodes = [s for _, s in kinds_specs]
    sources = [(n, o) for n, spec in enumerate(nodes) for o in range(spec[3])]
    targets = [(m, i) for m, spec in enumerate(nodes) for i in range(spec[2])]
    edges = []
    if sources and targets:
        picks = draw(st.lists(st.tuples(st.sampled_from(sources), st.sampled_from(targets)), max_size=12))
        # bias towards cycles: a ring through random nodes (output 0 -> input 0, where they exist)
        ring = draw(st.lists(st.integers(0, len(nodes) - 1), max_size=5))
        for a, b in zip(ring, ring[1:] + ring[:1]):
            if nodes[a][3] and nodes[b][2]:
                picks.append(((a, 0), (b, 0)))
        for (n, o), (m, i) in picks:
            if nodes[n][1] != nodes[m][0]:
                continue  # depths must match
            if acyclic_only_through_feedback and m <= n:
                if kinds[m] != "feedback":
                    continue
                d = nodes[m][0]
                if any(min_keep(nodes[w]) < d for w in range(m, n + 1)):
                    continue
            edges.append(((n, o), (m, i)))
    return Graph(nodes, edges)


@st.composite
def ring_graph(draw, max_depth: int = 3):
    """A closed walk through depth space (enter / leave / feedback / general steps) as a ring of
    nodes, plus random chords from second outputs: most cycles cross scope levels."""
    d0 = draw(st.integers(1, max_depth))
    d = d0
    specs = []
    for _ in range(draw(st.integers(1, 7))):
        kinds = ["op", "feedback"] + (["enter"] if d < max_depth else []) + (["leave"] if d > 1 else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "op":
            step, dout = draw(op_step(d)), d
        elif kind == "feedback":
            step, dout = ("feedback", draw(st.integers(1, 2))), d
        elif kind == "enter":
            step, dout = ("enter", None), d + 1
        else:
            step, dout = ("leave", None), d - 1
        specs.append((d, dout, step))
        d = dout
    while d != d0:  # close the walk
        step, dout = (("enter", None), d + 1) if d < d0 else (("leave", None), d - 1)
        specs.append((d, dout, step))
        d = dout
    nodes = []
    for din, dout, step in specs:
        outs = draw(st.integers(1, 2))
        nodes.append((din, dout, 1, outs, [[[step] for _ in range(outs)]]))
    n = len(nodes)
    edges = [((k, 0), ((k + 1) % n, 0)) for k in range(n)]
    for k in range(n):
        if nodes[k][3] == 2:
            matching = [m for m in range(n) if nodes[m][0] == nodes[k][1]]
            edges.append(((k, 1), (draw(st.sampled_from(matching)), 0)))
    return Graph(nodes, edges)


@st.composite
def update_batches(draw, g: Graph, max_batches: int = 6):
    locs = g.locations
    if not locs:
        return []

    def upd():
        loc = draw(st.sampled_from(locs))
        d = g.depth[loc]
        t = draw(st.integers(0, 4)) if d == 1 else tuple(draw(st.lists(st.integers(0, 3), min_size=d, max_size=d)))
        return loc, t, draw(st.sampled_from([-2, -1, -1, 1, 1, 1, 2]))

    batches = []
    for _ in range(draw(st.integers(1, max_batches))):
        batches.append([upd() for _ in range(draw(st.integers(0, 6)))])
    return batches



def graphs_and_updates(max_depth: int):
    return graph(max_depth, acyclic_only_through_feedback=True).flatmap(
        lambda g: st.tuples(st.just(g), update_batches(g))
    )

