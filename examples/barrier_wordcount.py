"""Word count in a Megaphone operator, to run on a Spark cluster (or with ``timely.launch``)::

    python -m spark_bridge.launch -w 2 --master 'local[2]' examples/barrier_wordcount.py --epochs 20 --migrate
    python -m timely.launch -w 2 examples/barrier_wordcount.py --epochs 20

Every epoch each worker reads its share of generated lines (deterministic, so that
``checkpoint.source`` can read an epoch again after a restart), splits them into words and counts
them in a Megaphone state machine keyed by word, whose bins are checkpointed state (with
checkpoints on). With ``--migrate``, worker 0 moves a bin to another worker every third epoch
while the words flow (live state migration). Each worker returns ``{"counts": {word: count} of the
words it holds, "bins": the bins it owns}``: together, the sequential word count
:func:`expected` and the routing :func:`expected_bins`.

Options: ``--epochs E`` (default 20); ``--migrate``; ``--out URL``: write each epoch's ``(word,
running count)`` records there with ``checkpoint.sink`` (exactly once across restarts; the
sequential version is :func:`expected_records`); ``--pause S``: sleep ``S`` seconds per epoch read
(a slower job, for tests); ``--log DIR``: each worker appends a JSON line per run (its pid and the
epoch it resumes from) to ``DIR/runs-w<index>.jsonl`` and one line per epoch it reads
(``<job id> <epoch>``) to ``DIR/reads-w<index>.txt``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections import Counter

import megaphone
import timely
from timely import ProbeHandle, checkpoint

VOCABULARY = ("timely dataflow spark barrier stage task worker epoch frontier progress capability bin "
              "megaphone migration checkpoint restart executor driver shuffle record batch operator").split()
LINES = 12  # per epoch, over all workers
WORDS = 8  # per line
K = 4  # 2^4 Megaphone bins


def lines(epoch: int) -> list[str]:
    """Every line of ``epoch`` (all workers'), in order."""
    out = []
    for i in range(LINES):
        rnd = random.Random(epoch * 7919 + i)
        out.append(" ".join(rnd.choice(VOCABULARY) for _ in range(WORDS)))
    return out


def moves(epoch: int, peers: int) -> list[tuple[str, int, int]]:
    """Megaphone's control records at ``epoch`` (``--migrate``): every third epoch one bin moves to
    the worker after its first owner."""
    if epoch % 3 != 1:
        return []
    b = (epoch // 3) % (1 << K)
    return [("move", b, (b + 1) % peers)]


def expected(epochs: int) -> dict[str, int]:
    """The sequential word count of ``epochs`` epochs."""
    return dict(Counter(word for e in range(epochs) for line in lines(e) for word in line.split()))


def expected_records(epochs: int) -> dict[int, list[tuple[str, int]]]:
    """The sequential ``--out`` records: per epoch, ``(word, running count)`` for every word read in it."""
    counts: Counter[str] = Counter()
    out: dict[int, list[tuple[str, int]]] = {}
    for e in range(epochs):
        out[e] = []
        for line in lines(e):
            for word in line.split():
                counts[word] += 1
                out[e].append((word, counts[word]))
        out[e].sort()
    return out


def expected_bins(epochs: int, peers: int, migrate: bool) -> dict[int, list[int]]:
    """The bins each worker owns at the end: the balanced table, then every move in order."""
    table = list(megaphone.balanced(1 << K, peers))
    for e in range(epochs if migrate else 0):
        for _, b, w in moves(e, peers):
            table[b] = w
    return {w: [b for b, owner in enumerate(table) if owner == w] for w in range(peers)}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="barrier_wordcount.py")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--migrate", action="store_true")
    p.add_argument("--out")
    p.add_argument("--pause", type=float, default=0.0)
    p.add_argument("--log")
    return p.parse_args(argv)


def _append(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def count(key: str, value: int, state: int | None) -> tuple[int, list[tuple[str, int]]]:
    """Megaphone fold: the running count of ``key``, emitted at every occurrence."""
    state = (state or 0) + value
    return state, [(key, state)]


def main(worker: timely.Worker) -> dict:
    opts = _args(list(worker.args))
    ck = worker.checkpoint
    if opts.log:
        os.makedirs(opts.log, exist_ok=True)
        _append(f"{opts.log}/runs-w{worker.index}.jsonl", json.dumps(
            {"pid": os.getpid(), "job": worker.job_id, "resume": None if ck is None else ck.resume_epoch}) + "\n")

    def read(epoch: int, index: int, peers: int) -> list[str] | None:
        if epoch >= opts.epochs:
            return None
        if opts.pause:
            time.sleep(opts.pause)
        if opts.log:
            _append(f"{opts.log}/reads-w{index}.txt", f"{worker.job_id} {epoch}\n")
        return lines(epoch)[index::peers]

    def read_moves(epoch: int, index: int, peers: int) -> list | None:
        if epoch >= opts.epochs:
            return None
        return moves(epoch, peers) if opts.migrate and index == 0 else []

    probe = ProbeHandle()
    with worker.dataflow() as scope:
        text = checkpoint.source(scope, "lines", read, max_in_flight=2, probe=probe)
        words = text.flat_map(lambda line: [(w, 1) for w in line.split()])
        control = checkpoint.source(scope, "moves", read_moves, max_in_flight=2, probe=probe)
        counts = megaphone.state_machine(words, control, None, count, k=K, name="WordCount")
        if opts.out:
            checkpoint.sink(counts.stream, opts.out, "counts", probe=probe)
        else:
            counts.stream.probe_with(probe)
    worker.step_while(lambda: not probe.done())
    return {"counts": dict(counts.state()), "bins": sorted(counts.owned_bins())}


if __name__ == "__main__":
    results = timely.execute(main, workers=2, args=["--migrate"])
    merged = {w: c for r in results for w, c in r["counts"].items()}
    print("word count matches the sequential one:", merged == expected(20))
