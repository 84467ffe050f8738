"""A dataflow on one worker: its operators, edges, progress tracker and step loop.

The graph is flat: operators of nested scopes live in the same dataflow and differ only in the
depth of their timestamps (Naiad's design), so one tracker and one progress channel serve the
whole dataflow. The build phase ends at :meth:`Dataflow.freeze`; the structure is fixed after it.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import BuildError, OperatorError, ProgressMismatchError, ProgressOrderError, TimelyError
from ..progress.reachability import Builder, Location, Source, Target, Tracker
from ..progress.timestamp import minimum
from .channels import Pact, body_limit, halved
from .context import Context
from .fuzz import Fuzzer
from .operator import InputPort, OperatorCore

if TYPE_CHECKING:  # pragma: no cover
    from ..worker import Worker
    from .scope import Stream


#: Steps records and progress may wait to be sent, however busy the worker.
FLUSH_STEPS = 16
#: How a worker's progress batches reach the other workers (``Worker(progress=...)``, ``--progress``):
#: ``"direct"`` sends each batch to every worker (timely's broadcast: w - 1 messages per worker and
#: round of flushes, w(w - 1) in all); ``"relay"`` sends it to worker :data:`RELAY` only, which
#: forwards the batches it received, several to a message, to every other worker: 2(w - 1) in all.
PROGRESS_MODES = ("direct", "relay")
#: The worker that relays progress in ``"relay"`` mode.
RELAY = 0


def check_progress_mode(progress: str) -> str:
    """``progress`` if it is one of :data:`PROGRESS_MODES`; :class:`ValueError` naming it otherwise."""
    if progress not in PROGRESS_MODES:
        raise ValueError(f"progress must be one of {', '.join(map(repr, PROGRESS_MODES))}, not {progress!r}")
    return progress


class Dataflow:
    """One dataflow instance on one worker."""

    def __init__(self, worker: Worker, name: str, fuzzer: Fuzzer | None = None) -> None:
        self.worker = worker
        self.name = name
        #: The dataflow's name in metrics, unique on its worker (the worker numbers repeated names).
        self.label = name
        self.index = worker.index
        self.peers = worker.peers
        self.ctx = Context(worker.index, worker.peers, fuzzer)
        self.ctx.activations.incoming = worker.allocator.incoming
        self.fuzzer = fuzzer
        self.progress = self.ctx.progress
        self.operators: list[OperatorCore] = []
        self.edges: list[tuple[Location, Location, str]] = []
        self.tracker: Tracker | None = None
        self.digest = 0
        self._pullers: dict[int, tuple[Any, InputPort]] = {}  # channel id -> (puller, the input it feeds)
        self._inputs: list[Any] = []  # InputHandles, flushed at each step
        self._unbuilt: set[int] = set()
        self._loops: list[Any] = []
        self._quiet_steps = 0  # steps since records or progress began waiting to be sent
        self._sent = 0  # sequence number of our next progress message
        self._received = [0] * self.peers  # next sequence number expected from each worker
        # The progress channel is allocated first, so its id is the same on every worker.
        self._progress_channel = worker.new_channel()
        self._progress_pushers, self._progress_puller = worker.allocate(self._progress_channel)
        # Relaying pays only with three workers or more: with two, the relay forwards to no one.
        self._relay = RELAY if worker.progress == "relay" and self.peers > 2 else None
        self._forward: list[tuple[tuple, list]] = []  # at the relay: others' batches to pass on, in arrival order

    # -- build phase -------------------------------------------------------------------------
    def add_operator(self, name: str) -> OperatorCore:
        """Reserve the next operator index."""
        if self.tracker is not None:
            raise BuildError(f"dataflow '{self.name}' is already built: cannot add operator '{name}'")
        op = OperatorCore(self.ctx, len(self.operators), name)
        self.operators.append(op)
        self._unbuilt.add(op.index)
        return op

    def operator_built(self, op: OperatorCore) -> None:
        """Called by the builder once the operator's logic is installed."""
        self._unbuilt.discard(op.index)

    def allocate_channel(self, target: InputPort, decoder: Callable[[Any], Any] | None = None
                         ) -> tuple[list[Any], Any]:
        """Allocate a worker-to-worker channel delivering into ``target``.

        Received messages must be ``(time, batch)``; with ``decoder``, ``decoder(puller)`` is read
        instead of the puller, and turns the messages the channel sent into that shape.
        """
        channel = self.worker.new_channel()
        pushers, puller = self.worker.allocate(channel)
        self._pullers[channel] = (puller if decoder is None else decoder(puller), target)
        return pushers, puller

    def connect(self, stream: Stream, port: InputPort, pact: Pact) -> None:
        """Add an edge from ``stream`` to input ``port`` through ``pact``."""
        src = self.operators[stream.node].outputs[stream.port]
        if src.levels != port.levels:
            raise BuildError(
                f"operator '{port.op.name}': input is in a scope of depth {port.levels}, stream of depth "
                f"{src.levels} (use enter()/leave())"
            )
        channel = pact.channel(self, port)
        channel.producer = src.op.name
        target = Target(port.op.index, port.port)
        src.channels.append((channel, target))
        self.edges.append((Source(stream.node, stream.port), target, repr(pact)))

    def register_input(self, handle: Any) -> None:
        """Remember an input handle so that each step flushes it."""
        self._inputs.append(handle)

    def register_loop(self, handle: Any) -> None:
        """Remember a feedback handle, which must be connected before the dataflow is built."""
        self._loops.append(handle)

    def freeze(self) -> None:
        """End the build phase: check the graph, initialise counts and frontiers."""
        for loop in self._loops:
            if not loop.connected:
                raise BuildError(f"dataflow '{self.name}': feedback '{loop.name}' was never connected (connect_loop)")
        if self._unbuilt:
            names = ", ".join(self.operators[i].name for i in sorted(self._unbuilt))
            raise BuildError(f"dataflow '{self.name}': operators never built: {names}")
        builder = Builder()
        for op in self.operators:
            builder.add_node(op.index, len(op.inputs), len(op.outputs), op.summary, op.name)
        for src, tgt, _ in self.edges:
            builder.add_edge(src, tgt)
        self.tracker = tracker = builder.build()
        # Progress updates name a location by its index here (every worker builds the same
        # dataflow, which the digest checks before any update is read): an int on the wire and a
        # list lookup at the receiver, instead of three fields and a new Location per update.
        self.locations: tuple[Location, ...] = tuple(sorted(tracker.pointstamps))
        self._location_ids = {loc: i for i, loc in enumerate(self.locations)}
        # The shape: operators, their summaries (a loop's feedback step, a scope's depth) and the
        # edges; workers that built loops of other steps would otherwise apply each other's updates.
        shape = repr(
            [(op.name, len(op.inputs), len(op.outputs), op.summary) for op in self.operators]
            + [(s, t, p) for s, t, p in self.edges]
        )
        self.digest = int.from_bytes(hashlib.blake2b(shape.encode(), digest_size=8).digest(), "big")
        # Invariant (ARCHITECTURE 2.4): every output starts with `peers` capabilities at the minimum time,
        # known to every worker without any exchange. Applied locally, never broadcast.
        for op in self.operators:
            for out in op.outputs:
                tracker.update(Source(op.index, out.port), minimum(out.levels), self.peers)
            for inp in op.inputs:
                inp.install(tracker.implications[Target(op.index, inp.port)])
        tracker.propagate_all()
        if self.fuzzer is not None:
            self.fuzzer.operators = len(self.operators)
        for op in self.operators:
            if op.frontier_interest or op.inputs and any(p.queue for p in op.inputs):
                op.activate()

    # -- run phase ---------------------------------------------------------------------------
    def next_timer(self) -> float | None:
        """Seconds until the next delayed activation (None: no timer pending)."""
        return self.ctx.activations.next_timer()

    def step(self, events: Iterable[int]) -> bool:
        """Receive, propagate, schedule active operators, send progress. True if anything happened.

        ``events`` are the channels that received messages since the last step (the allocator's
        events): only their pullers are read, and reading them activates the operators they feed.
        The progress channel is read every step.
        """
        activations = self.ctx.activations
        operators = self.operators
        did = False
        activations.fire_timers()
        for handle in self._inputs:
            handle.flush()
        if self._receive_progress():
            did = True
            for loc, _t, _d in self.tracker.propagate_all():  # type: ignore[union-attr]
                if not loc.source and operators[loc.node].frontier_interest:
                    activations.activate(loc.node)
        pullers = self._pullers
        for channel in events:
            entry = pullers.get(channel)
            if entry is not None:
                puller, port = entry
                msg = puller.pull()
                while msg is not None:
                    port.deliver(msg[0], msg[1])  # queues the batch and activates the operator
                    msg = puller.pull()
        if self.fuzzer is not None:
            self.fuzzer.step(activations.activate)
        watchdog = self.worker.watchdog
        ran = False
        for i in activations.run_order():
            ran = True
            if watchdog is None:
                operators[i].schedule()
            else:
                watchdog.enter(operators[i].name)
                try:
                    operators[i].schedule()
                finally:
                    watchdog.leave()
        did = did or ran
        # A busy worker gathers records (in its channels) and progress (in ctx.progress) across
        # steps, and sends both once a step runs no operator (the worker would otherwise go idle:
        # it never parks with anything unsent, see busy()) or after FLUSH_STEPS steps: messages
        # stay large, and their number per step small, even where each step changes little
        # (sparse streams, many peers). Invariant (ARCHITECTURE 2.2): the progress of several
        # steps is still sent as one whole batch; it is only later, as if the network were slower.
        forward = bool(self._forward)
        if self.ctx.pending or not self.progress.is_empty() or forward:
            self._quiet_steps += 1
            fuzzer = self.fuzzer
            # The relay passes batches on in the step that received them (every other worker's
            # frontiers wait for them), however busy it is; under the fuzzer, at random steps.
            if (not ran or self._quiet_steps >= FLUSH_STEPS or forward and fuzzer is None
                    or fuzzer is not None and fuzzer.send_now()):
                self._quiet_steps = 0
                # One message per peer for the whole flush (every channel's records, then the
                # progress), not one per channel and peer: at 16 workers a flush would otherwise
                # cost a ZeroMQ message to each of 15 peers per channel with records, plus 15 for
                # progress. The order per peer is kept, so the progress still follows the records.
                alloc = self.worker.allocator
                alloc.cork()
                try:
                    self._flush_channels()
                    if not self.progress.is_empty() or self._forward:
                        did = True
                        ids = self._location_ids
                        self._send_progress([(ids[loc], t, d) for (loc, t), d in self.progress.drain()])
                finally:
                    alloc.uncork()
        return did

    def _send_progress(self, updates: list) -> None:
        """Broadcast this step's progress batch ``((digest, sender, seq), updates)``, encoded once for
        every other worker (a step's cost then grows with the peers only by the copies sent); in
        ``"relay"`` mode, see :meth:`_relay_progress`."""
        if self._relay is not None:
            self._relay_progress(self._relay, updates)
            return
        for items, body in self._pieces(updates):
            head = (self.digest, self.index, self._sent)
            self._sent += 1
            for worker, pusher in enumerate(self._progress_pushers):
                if worker == self.index:
                    pusher.push((head, items))
                else:
                    pusher.push_items(head, [body], len(items))

    def _pieces(self, updates: list) -> list[tuple[list, Any]]:
        """``updates`` as batches that fit one message each, with their encoding: one, or, when
        too large (many times in one step under a small ``max_message_bytes``), the positive
        updates first, then pieces cut to fit. Each piece is a batch of its own (its own sequence
        number), applied when it arrives. Invariant relied on: applying a step's positive updates
        before its negative ones (and any part of the negatives after all the positives) never
        shows a frontier beyond the true one: a +1 only holds times back, and every -1 of the step
        is matched by the +1s it came with, which are in place by then."""
        remote = next((p for w, p in enumerate(self._progress_pushers) if w != self.index), None)
        if remote is None:
            return [(updates, None)]
        body = remote.encode_items(updates)
        limit = remote.max_bytes
        if limit is None or len(body) <= body_limit(limit) or len(updates) == 1:
            return [(updates, body)]
        ordered = sorted(updates, key=lambda u: u[2] < 0)  # (stable: positives first, in order)
        out, at = [], 0
        for count, piece in halved(remote.encode_items, ordered, body_limit(limit)):
            out.append((ordered[at:at + count], piece))
            at += count
        return out

    def _relay_progress(self, relay: int, updates: list) -> None:
        """``"relay"`` mode: our batch (if ``updates``) goes to us and to the relay only; the relay
        sends its own and the batches it received since its last flush to every other worker as one
        ``(None, batches)`` message, encoded once (each receiver skips its own batches, which it
        applied when it sent them).

        Invariant (ARCHITECTURE 2.3) kept: every batch still arrives whole and exactly once at every
        worker, and in its sender's order: the relay forwards in the order it received, which is
        each sender's order, and its own batches join the same sequence."""
        batches = self._forward
        if updates:
            for items, body in self._pieces(updates):
                head = (self.digest, self.index, self._sent)
                self._sent += 1
                self._progress_pushers[self.index].push((head, items))
                if self.index != relay:
                    self._progress_pushers[relay].push_items(head, [body], len(items))  # (encoded once, in _pieces)
                else:
                    batches.append((head, items))
            if self.index != relay:
                return
        if not batches:
            return
        self._forward = []
        pieces = None
        for worker, pusher in enumerate(self._progress_pushers):
            if worker != self.index:
                if pieces is None:  # within one message each; every batch stays whole, in order
                    limit = pusher.max_bytes
                    pieces = halved(pusher.encode_items, batches, body_limit(limit))
                for count, body in pieces:
                    pusher.push_items(None, [body], count)

    def _flush_channels(self) -> None:
        """Send the records channels gathered."""
        pending = self.ctx.pending
        while pending:
            channel = pending.pop()
            try:
                channel.flush()
            except (TypeError, ValueError) as e:  # a small part's record, encoded only now, cannot be sent
                if isinstance(e, TimelyError):
                    raise
                raise OperatorError(channel.producer, self.index, e) from e

    def _receive_progress(self) -> bool:
        """Apply every progress message received (our own included); True if there was any."""
        messages = self._progress_puller.drain()
        tracker = self.tracker
        assert tracker is not None
        if self._relay is not None:
            messages = self._relayed(messages)
        elif any(head is None for head, _ in messages):
            raise ProgressMismatchError(self._mode_mismatch("relayed progress from worker 0"))
        for (digest, sender, seq), updates in messages:
            if digest != self.digest:
                raise ProgressMismatchError(
                    f"dataflow '{self.name}': worker {sender} built a different dataflow than worker "
                    f"{self.index}; every worker must create the same operators in the same order"
                )
            # Invariant (ARCHITECTURE 2.3): each worker's batches arrive whole, in order, exactly once.
            if seq != self._received[sender]:
                raise ProgressOrderError(
                    f"dataflow '{self.name}': worker {self.index} received progress message {seq} from worker "
                    f"{sender}, expected {self._received[sender]} (lost, duplicated or reordered)"
                )
            self._received[sender] = seq + 1
            locations = self.locations
            tracker.update_batch(((locations[i], t), d) for i, t, d in updates)
        return bool(messages)

    def _relayed(self, messages: list) -> list:
        """``"relay"`` mode: the batches of ``messages`` to apply, in order: a relay's
        ``(None, batches)`` message holds several (less our own); the relay keeps the others'
        batches it receives to pass them on."""
        batches: list = []
        me = self.index
        forward = self._forward if me == self._relay else None
        for head, body in messages:
            if head is None:
                batches.extend(b for b in body if b[0][1] != me)
            else:
                if forward is None and head[1] != me:  # only the relay hears from others directly
                    raise ProgressMismatchError(self._mode_mismatch(f"progress straight from worker {head[1]}"))
                batches.append((head, body))
                if forward is not None and head[1] != me:
                    forward.append((head, body))
        return batches

    def _mode_mismatch(self, what: str) -> str:
        return (f"dataflow '{self.name}': worker {self.index} (progress mode '{self.worker.progress}') received "
                f"{what}: every worker must use the same progress mode (--progress)")

    def never_built_by(self, finished: Iterable[int]) -> list[int]:
        """Of the ``finished`` workers, those that sent no progress for this incomplete dataflow.

        Every worker that builds a dataflow with operators sends progress for it (it drops its
        share of the initial capabilities, ARCHITECTURE 2.4), so a worker that finished without
        a word never built it: this dataflow can never complete.
        """
        if self.complete() or not self.operators:
            return []
        if self._relay is not None and self.index != self._relay and self._relay not in finished:
            # Others' batches reach us through the relay, on another connection than their
            # goodbye: only once the relay has finished has everything it forwarded arrived (and
            # the relay itself judges a worker that never built the dataflow).
            return []
        return sorted(p for p in finished if p != self.index and self._received[p] == 0)

    def wake_idle(self) -> bool:
        """Schedule the operators waiting for an idle worker (``Activator.activate_when_idle``);
        True if there were any."""
        return self.ctx.activations.wake_idle()

    def busy(self) -> bool:
        """True when operators are waiting to run, or records or progress wait to be sent."""
        return (bool(self.ctx.activations.active) or not self.progress.is_empty() or bool(self.ctx.pending)
                or bool(self._forward)
                or self.fuzzer is not None and self.fuzzer.holding())

    def release(self) -> None:
        """Let go of what this completed dataflow holds: its channels' queues in the allocator and
        its operators' logic (their state). A handle the job keeps (a closed input, a stream)
        would otherwise keep all of it alive for as long as ``main`` runs."""
        self.worker.allocator.retire([self._progress_channel, *self._pullers])
        for op in self.operators:
            op.logic = None
        self._pullers.clear()
        self._inputs.clear()
        self._loops.clear()

    def complete(self) -> bool:
        """True when no pointstamp remains anywhere: nothing can happen in this dataflow any more."""
        return (
            self.tracker is not None
            and not self.tracker.tracking_anything()
            and self.progress.is_empty()
            and not self._forward
            and not self.ctx.activations.active
        )
