"""Schedule fuzzing: a seeded adversary that delivers data in orders timely allows but rarely shows.

Timely promises an operator nothing about the order in which the batches at an input arrive (on
several workers each peer's part of an exchange can come first), nor about how records are cut into
batches, nor that it is scheduled only when there is work. An operator correct on one schedule may be
wrong on another. With ``fuzz=SEED`` (``timely.execute``, ``Worker``, ``python -m timely.launch
--fuzz``), every batch delivered to an operator input passes through a :class:`Fuzzer`, which

* holds it back for one or more steps (records in flight: the frontier cannot pass their time),
* splits it at a random point into two batches, and delivers either one first (so records of
  one time arrive in any order, not only the order they were sent in),
* releases what it holds in random order (across times too),
* schedules each operator at random steps, with or without work,
* and sends a busy step's gathered records and progress at random steps (a worker may send them
  at the end of any step; see ``Dataflow.step``).

It never drops, duplicates or invents records, and it never touches progress: a held batch stays
counted at its input (ARCHITECTURE 2.1), so no frontier passes its time before it is delivered. The
decisions come from one random generator per worker and dataflow, seeded by ``(seed, worker,
dataflow)``: on one worker a failing seed reproduces the failure exactly; on several, the arrival
order of the network adds its own variation.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

#: Probability that a held batch stays held for another step.
DELAY = 0.35
#: Probability that a released batch of two or more records is split in two (the rest held again).
SPLIT = 0.35
#: Probability, per step and operator, of scheduling the operator with or without work (each
#: operator on its own: one random operator per step scheduled a given one too rarely to catch an
#: operator that assumes it runs only with work, 1-2 seeds in 20).
SPURIOUS = 0.2
#: Probability that the operator of a batch held back is scheduled all the same: with part of its
#: input in flight and nothing delivered, the moment an operator that assumes it runs only with
#: complete work goes wrong.
WAKE_HELD = 0.5
#: Probability that a busy step sends what it gathered (records and progress) at its end.
SEND = 0.5


class Port(Protocol):
    """An operator input as the fuzzer sees it: a queue of ``(time, batch, length)`` and its operator."""

    queue: Any
    op: Any


class Fuzzer:
    """Holds the batches delivered to one dataflow's inputs and releases them in a seeded order."""

    __slots__ = ("rng", "held", "operators")

    def __init__(self, seed: int, worker: int, dataflow: int) -> None:
        self.rng = random.Random(f"timely-fuzz:{seed}:{worker}:{dataflow}")
        self.held: list[tuple[Port, Any, Sequence, int]] = []
        self.operators = 0  # how many operators the dataflow has (set when it is built)

    def hold(self, port: Port, time: Any, batch: Sequence, n: int) -> None:
        """Take a batch of ``n`` records delivered to ``port`` at ``time``; it reaches the operator
        at a later step."""
        self.held.append((port, time, batch, n))

    def send_now(self) -> bool:
        """Whether a busy step sends its gathered records and progress now (else a later step does)."""
        return self.rng.random() < SEND

    def holding(self) -> bool:
        """True while some batch waits to be delivered."""
        return bool(self.held)

    def step(self, activate: Any) -> None:
        """Deliver some held batches (some split) in random order, keep the others; schedule each
        operator with probability :data:`SPURIOUS` through ``activate(index)``."""
        rng = self.rng
        for index in range(self.operators):
            if rng.random() < SPURIOUS:
                activate(index)
        if not self.held:
            return
        held, self.held = self.held, []
        rng.shuffle(held)
        for port, time, batch, n in held:
            if rng.random() < DELAY:
                self.held.append((port, time, batch, n))
                if rng.random() < WAKE_HELD:
                    port.op.activate()
                continue
            if n > 1 and len(batch) == n and rng.random() < SPLIT:
                # Either part first: records of one time have no order either (the parts are copies:
                # the batch itself may be another consumer's too). A batch changed since it was
                # delivered goes whole: its consumer reports the change.
                cut = rng.randrange(1, n)
                now, later = (batch[:cut], batch[cut:]) if rng.random() < 0.5 else (batch[cut:], batch[:cut])
                self.held.append((port, time, later, len(later)))
                batch, n = now, len(now)
            port.queue.append((time, batch, n))
            port.op.activate()
