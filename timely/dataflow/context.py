"""What the operators of one dataflow share: the step's progress batch and the activations.

Operators and capabilities hold this small context instead of the dataflow or the worker (as
timely-dataflow's operators hold a shared progress batch and an activator): they can record
progress and ask to be scheduled, and know nothing else of the layers above them.
"""
from __future__ import annotations

import heapq
import time as _time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..progress.change_batch import ChangeBatch

if TYPE_CHECKING:  # pragma: no cover
    from .fuzz import Fuzzer


class Activations:
    """The operators scheduled to run: a min-heap of operator indices, plus delayed activations and
    the operators waiting for the worker to be idle."""

    __slots__ = ("active", "_active_set", "_timers", "_idle", "incoming")

    def __init__(self) -> None:
        #: True when the worker has received (or can receive) a message not yet handled: the
        #: allocator's ``incoming``, set when the dataflow is made.
        self.incoming: Callable[[], bool] = lambda: False
        self.active: list[int] = []  # heap of operator indices
        self._active_set: set[int] = set()
        self._timers: list[tuple[float, int, bool]] = []  # heap of (monotonic deadline, operator index, when idle)
        self._idle: set[int] = set()  # to run once the worker has nothing else to do

    def activate(self, index: int) -> None:
        """Schedule operator ``index`` (once, however often it is asked)."""
        if index not in self._active_set:
            self._active_set.add(index)
            heapq.heappush(self.active, index)

    def activate_after(self, index: int, delay: float, when_idle: bool = False) -> None:
        """Schedule operator ``index`` once ``delay`` seconds have passed (``when_idle``: then
        :meth:`activate_when_idle`)."""
        heapq.heappush(self._timers, (_time.monotonic() + delay, index, when_idle))

    def activate_when_idle(self, index: int) -> None:
        """Schedule operator ``index`` once the worker has nothing else to do: at the first step
        after one that ran no operator and left nothing to send (:meth:`wake_idle`)."""
        self._idle.add(index)

    def wake_idle(self) -> bool:
        """Schedule the operators waiting for an idle worker; True if there were any."""
        if not self._idle:
            return False
        for i in self._idle:
            self.activate(i)
        self._idle.clear()
        return True

    def fire_timers(self) -> None:
        """Schedule every operator whose delay has passed."""
        timers = self._timers
        if timers:
            now = _time.monotonic()
            while timers and timers[0][0] <= now:
                _, index, when_idle = heapq.heappop(timers)
                (self.activate_when_idle if when_idle else self.activate)(index)

    def next_timer(self) -> float | None:
        """Seconds until the next delayed activation (None: no timer pending)."""
        return max(0.0, self._timers[0][0] - _time.monotonic()) if self._timers else None

    def run_order(self) -> Iterator[int]:
        """Yield the operators to run in this pass, in index order, taking each off the schedule.

        An operator activated while the pass runs joins it at a larger index than the last one run
        (data flows forward); at a smaller or equal one (a loop) it stays scheduled for the next step.
        """
        active, active_set = self.active, self._active_set
        deferred = []
        last = -1
        while active:
            i = heapq.heappop(active)
            if i <= last:
                deferred.append(i)  # still in the set: runs next step, not queued twice
                continue
            active_set.discard(i)
            last = i
            yield i
        for i in deferred:
            heapq.heappush(active, i)


class Activator:
    """Schedules one operator: ``activate()`` in this or the next step, ``activate_after(s)`` later."""

    __slots__ = ("_activations", "index")

    def __init__(self, activations: Activations, index: int) -> None:
        self._activations = activations
        self.index = index

    def activate(self) -> None:
        """Schedule the operator in the current or the next step."""
        self._activations.activate(self.index)

    def activate_after(self, delay: float, when_idle: bool = False) -> None:
        """Schedule the operator once ``delay`` seconds have passed (the worker parks until then);
        ``when_idle``: then as :meth:`activate_when_idle`."""
        self._activations.activate_after(self.index, delay, when_idle)

    def activate_when_idle(self) -> None:
        """Schedule the operator once the worker has nothing else to do: after the steps that
        handle what has arrived and send what they produced, before the worker would park.
        Background work (a state copy) then waits for no record, but it never runs while the
        worker stays busy."""
        self._activations.activate_when_idle(self.index)

    def work_waiting(self) -> bool:
        """True when the worker has other work: a message received or arriving, or another operator
        scheduled. Background work run when idle checks it between small pieces and gives way
        (then asks :meth:`activate_when_idle` again), so a message from a peer, which may be the
        progress a whole epoch waits for, waits for one piece at most."""
        acts = self._activations
        return bool(acts.active) or acts.incoming()

    def __repr__(self) -> str:
        return f"Activator(operator={self.index})"


class Context:
    """One dataflow's shared state for its operators: worker ``index`` of ``peers``, the progress
    batch of the current step(s), the activations, the schedule fuzzer (``None`` unless fuzzing),
    and the channels holding gathered records (``pending``, flushed by the dataflow)."""

    __slots__ = ("index", "peers", "progress", "activations", "fuzzer", "pending")

    def __init__(self, index: int, peers: int, fuzzer: Fuzzer | None = None) -> None:
        self.index = index
        self.peers = peers
        self.fuzzer = fuzzer
        # Invariant (ARCHITECTURE 2.2): every change of one step goes into this one batch, which is sent
        # whole; it is never split between progress messages.
        self.progress = ChangeBatch()
        self.activations = Activations()
        # Channels with records gathered for other workers. Invariant: the dataflow flushes them with
        # its progress (Dataflow.step), before its worker could park: a gathered record is counted,
        # so it holds its time back like a record in flight, never for longer than FLUSH_STEPS steps.
        self.pending: list[Any] = []
