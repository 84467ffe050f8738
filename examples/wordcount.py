"""Word count over a few epochs: `python -m timely.launch -w 2 examples/wordcount.py [epochs]`.

Each worker feeds its share of the lines; words are exchanged by word so that each word is counted
on one worker; each worker prints the counts it owns once an epoch is complete.
"""
from __future__ import annotations

import sys

import timely

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a timely dataflow counts the words of the fox",
    "the dog sleeps and the fox runs",
]


def say(line: str) -> None:
    """Print a whole line in one write, so lines of concurrent workers do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(worker: timely.Worker):
    epochs = int(worker.args[0]) if worker.args else 3
    with worker.dataflow() as scope:
        inp = scope.new_input()
        counts = (
            inp.stream.flat_map(str.split)
            .count_by_key()  # per epoch: (word, count), words exchanged by their hash
            .inspect_batch(lambda t, batch: say(
                f"worker {worker.index} epoch {t}: " + ", ".join(f"{w}={c}" for w, c in sorted(batch))))
        )
        probe = counts.probe()
    total = 0
    for epoch in range(epochs):
        for i, line in enumerate(TEXT):
            if (i + epoch) % worker.peers == worker.index:  # each worker sends its share
                inp.send(line)
                total += len(line.split())
        inp.advance_to(epoch + 1)
        worker.step_while(lambda: probe.less_than(inp.time))
    inp.close()
    return total


if __name__ == "__main__":
    print("words sent per worker:", timely.execute(main, workers=1))
