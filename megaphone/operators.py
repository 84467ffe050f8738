"""Migratable operators: the routing operator F and the state operator S of the Megaphone paper.

For ``n`` keyed data inputs sharing one control stream::

    data_i ──► F ──(records at t, routed by the table in force at t)──► S (bins of state) ──► output
    control ─► F ──(state chunks of moving bins, at migration time t)──┘        │
               ▲                                                              │
               └──────────── probe on S's output (frontier only, no cycle) ◄──┘

F (:mod:`megaphone.route`) and S (:mod:`megaphone.state`) of one worker share the bins
(:mod:`megaphone.bins`). This module wires them with the public operator builder and offers the
three constructors ``unary``, ``binary`` and ``state_machine``.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from timely import (
    Broadcast,
    BuildError,
    Capability,
    Distribute,
    OperatorBuilder,
    Pact,
    ProbeHandle,
    Stream,
    Summary,
    routing,
)

from .bins import ROWS, MegaphoneError, Shared, StateCodec
from .checkpoint import BinCheckpoint
from .control import ControlInput
from .route import ExtractionWaker, RoutingOperator
from .state import PerTime, StateOperator, per_record_time
from .table import Table, TableError, validate_k

DEFAULT_CHUNK = 1 << 15  # state entries per state message: large bins move in bounded chunks


def _key_fn(key: Any) -> Any:
    if key is None or isinstance(key, int) or callable(key):
        return key
    raise TypeError(f"key must be a field index, a function or None, not {key!r}")


class Migratable:
    """A migratable operator's handle: ``stream`` (its output), ``probe`` (on that output),
    ``copied`` (the copies ahead), ``routing_table()`` and ``events`` (per-step migration records
    of this worker)."""

    def __init__(self, stream: Stream, probe: ProbeHandle, shared: Shared, copied: ProbeHandle) -> None:
        self.stream = stream
        self.probe = probe
        #: Passes a time once every copy ahead requested at it is staged (:mod:`megaphone.precopy`).
        self.copied = copied
        self._shared = shared

    def routing_table(self) -> Table:
        """Bin -> worker, as of the newest configuration this worker has compiled."""
        return self._shared.routing_table()

    @property
    def events(self) -> deque[dict]:
        """Migration events on this worker, the newest ``megaphone.bins.MAX_EVENTS``: ``{"kind":
        "extract"|"install", "time", "bins", "entries", "bytes", "seconds", ...}``."""
        return self._shared.events

    def state(self) -> Any:
        """The state of every bin this worker holds, merged into one: a dict for the row operators
        (for ``state_machine``: key -> state), a ``pyarrow.Table`` for :func:`megaphone.aggregate`.
        Read it between steps; it changes as the dataflow runs and bins move."""
        return self._shared.codec.merged([b.state for b in self._shared.bins if b is not None])

    def replicas(self) -> dict[int, dict[str, Any]]:
        """The standby replicas of the bins this worker holds (:meth:`ControlInput.replicate
        <megaphone.ControlInput.replicate>`): ``{bin: {"worker", "staged", "refreshes", "entries",
        "bytes", "pending"}}`` (:meth:`megaphone.precopy.PreCopier.replica_status`)."""
        return self._shared.precopier.replica_status() if self._shared.precopier is not None else {}

    def owned_bins(self) -> list[int]:
        """The bins currently held by this worker."""
        return [b for b, x in enumerate(self._shared.bins) if x is not None]


RoutePact = Callable[[Any, Shared], Pact]  # (key, shared) -> the pact from F to S for one data input


def _row_pact(key: Any, shared: Shared) -> Pact:
    """Rows go to the worker that the routing table in force at their time gives their bin."""
    k, name = shared.k, shared.name

    def partition(time: Any, batch: Sequence, peers: int) -> list:
        try:
            return routing.route_bins(batch, key, k, shared.table_at(time), peers)[0]
        except Exception as e:
            raise MegaphoneError(f"'{name}': key function failed: {e}") from e

    return Distribute(partition)


def _check_chunk(chunk: Any, name: str) -> None:
    """Raise :class:`BuildError` naming the operator unless ``chunk`` (the most state entries in one
    state message) is an integer >= 1: a chunk of 0 cannot cut a bin, and a negative one would cut
    a bin into no chunks at all, so the bin would be lost at its first move."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise BuildError(f"'{name}': chunk must be an integer >= 1 (state entries per state message), "
                         f"not {chunk!r}")


def _restored_control(control: ControlInput, name: str, table: Table) -> None:
    """Make ``table``, restored from a checkpoint by operator ``name``, the table that ``control``
    (and a :class:`~megaphone.Controller` on it, which defaults to ``control.initial``) starts
    from. Every worker restores the same table (the checkpoint's, written by worker 0, or a
    balanced one when rescaling), and every operator on one control input has received the same
    configuration updates, so they restore the same table; raise :class:`BuildError` if not."""
    previous = control.restored_by
    if previous is not None and control.initial != table:
        raise BuildError(f"'{name}': restored the routing table {list(table)} from the checkpoint, but "
                         f"'{previous}' on the same control input '{control.name}' restored {list(control.initial)}")
    control.initial = table
    control.restored_by = name


def _build(streams: Sequence[Stream], control: ControlInput | Stream, keys: Sequence[Any], fold: Callable | None,
           k: int | None, name: str, chunk: int, per_time: PerTime | None = None, pact: RoutePact = _row_pact,
           codec: StateCodec = ROWS) -> Migratable:
    """F and S over ``streams`` (one key each): ``pact(key, shared)`` routes a data input from F to S
    (by the table in force at each record's time), ``codec`` makes and ships the bins' state, and S
    applies a complete time with ``per_time`` when it has no timers then, else per bin with ``fold``."""
    scope = streams[0].scope
    if scope.levels != 1:
        raise BuildError(f"'{name}': migratable operators need integer (top-level) timestamps")
    ctrl_stream = control.stream if isinstance(control, ControlInput) else control
    if k is None:
        k = control.k if isinstance(control, ControlInput) else 8
    try:
        k = validate_k(k)
    except TableError as e:
        raise TableError(f"'{name}': {e}") from None
    if isinstance(control, ControlInput) and k != control.k:
        # The control input validates bins against its own 2^k (and a Controller plans over them):
        # another k here would let through moves of bins this operator does not have, or never
        # move some of its bins, and fail every worker at the first such move.
        raise BuildError(f"'{name}': k={k} (2^{k} bins) differs from k={control.k} (2^{control.k} bins) "
                         f"of its control input '{control.name}'; leave k out to take the control input's")
    _check_chunk(chunk, name)
    n = len(streams)
    initial = control.initial if isinstance(control, ControlInput) else None  # spare workers
    shared = Shared(name, k, scope.index, scope.peers, codec, initial)
    ck = scope.worker.checkpoint
    if ck is not None:
        shared.checkpoint = BinCheckpoint(shared, ck)  # restores this worker's bins and F's table
        if isinstance(control, ControlInput) and shared.checkpoint.restored:
            _restored_control(control, name, shared.config_tables[0])
    probe = ProbeHandle()
    ident = Summary.identity(1)

    # F: inputs data_0..data_{n-1}, control; outputs data_0..data_{n-1}, state, copy (ahead of a
    # hand-over, and the replicas' refreshes at the times of data records: megaphone.precopy).
    fb = OperatorBuilder(scope, f"{name} F")
    f_outs, f_streams = zip(*(fb.new_output() for _ in range(n + 2)))
    f_data = [fb.new_input(s, None, [[ident] if o in (i, n + 1) else [] for o in range(n + 2)])
              for i, s in enumerate(streams)]
    # The control input is broadcast: every F sees every update. It connects only to the state and copy outputs.
    f_ctrl = fb.new_input(ctrl_stream, Broadcast(), [[] for _ in range(n)] + [[ident], [ident]])
    fb.set_frontier_interest(True)
    copied = ProbeHandle()
    f_op = RoutingOperator(shared, n, f_ctrl.frontier, probe, chunk, copied, fb.activator)

    def build_f(caps: list[Capability]) -> Callable[[], None]:
        for c in caps:
            c.drop()
        return lambda: f_op.run(f_data, f_ctrl, list(f_outs[:n]), f_outs[n], f_outs[n + 1])

    fb.build(build_f)

    # S: inputs data_0..data_{n-1} (routed by the table at the record's time), state (by target).
    def route_state(time: Any, batch: Sequence, peers: int) -> list:
        parts: list[list] = [[] for _ in range(peers)]
        for r in batch:
            parts[r[0]].append(r)
        return parts

    # S: outputs the records and an ack stream (no records) whose frontier follows the copy input
    # alone: the copy input holds no record back, and a probe on the ack stream tells the controller
    # that every copy ahead of a time is staged.
    sb = OperatorBuilder(scope, name)
    s_out, s_stream = sb.new_output()
    _, ack_stream = sb.new_output()
    served: list[list[Summary]] = [[ident], []]
    s_data = [sb.new_input(f_streams[i], pact(key, shared), served) for i, key in enumerate(keys)]
    s_state = sb.new_input(f_streams[n], Distribute(route_state), served)
    s_copy = sb.new_input(f_streams[n + 1], Distribute(route_state), [[], [ident]])
    sb.set_frontier_interest(True)
    shared.s_activator = sb.activator
    s_op = StateOperator(shared, keys, fold, [i.frontier for i in s_data] + [s_state.frontier], per_time)

    def build_s(caps: list[Capability]) -> Callable[[], None]:
        if shared.checkpoint is not None:  # restored timers, held before any record is applied
            for b, t, p in shared.checkpoint.timers:
                bin_ = shared.bins[b]
                assert bin_ is not None
                s_op.add_timer(b, bin_, t, p, caps[0])
            shared.checkpoint.timers = []
        caps[0].drop()
        caps[1].drop()
        return lambda: s_op.run(s_data, s_state, s_out, s_copy)

    sb.build(build_s)
    out = s_stream.probe_with(probe)
    ack_stream.probe_with(copied)
    if isinstance(control, ControlInput):
        control.attach(copied)
    probe.watch(ExtractionWaker(f_op))  # F wakes up when S's output frontier moves and bins wait for it
    return Migratable(out, probe, shared, copied)


def unary(stream: Stream, control: Any, key: Any, fold: Callable, k: int | None = None,
          name: str = "MegaphoneUnary", chunk: int = DEFAULT_CHUNK) -> Migratable:
    """A migratable one-input operator with per-bin state and timers.

    ``fold(time, records, timers, state, notificator)`` is called per bin for every complete time at
    which the bin has records or timers, in time order; ``state`` is the bin's dict (keyed as you
    like); ``notificator.notify_at(t, payload)`` posts ``payload`` back to this bin at ``t``; the
    iterable it returns is emitted at ``time``. ``key`` (field index, function or None) picks the
    routing key of a record; ``k`` gives the 2^k bins (default: the control input's).
    """
    return _build([stream], control, [_key_fn(key)], fold, k, name, chunk)


def binary(stream1: Stream, stream2: Stream, control: Any, key1: Any, key2: Any, fold: Callable,
           k: int | None = None, name: str = "MegaphoneBinary", chunk: int = DEFAULT_CHUNK) -> Migratable:
    """A migratable two-input operator (for example a join): both inputs share one configuration.

    ``fold(time, records1, records2, timers, state, notificator)`` per bin and complete time.
    """
    return _build([stream1, stream2], control, [_key_fn(key1), _key_fn(key2)], fold, k, name, chunk)


def state_machine(stream: Stream, control: Any, key: Any, fold: Callable, k: int | None = None,
                  name: str = "StateMachine", chunk: int = DEFAULT_CHUNK) -> Migratable:
    """A migratable per-key state machine over ``(key, value)`` records.

    ``fold(key, value, state)`` gets the key's state (``None`` at first) and returns
    ``(keep_state, outputs)``: the new state to keep (``None`` discards it) and an iterable of
    output records, emitted at the record's time. Records of one key are applied in time order
    (those of one time in the order they arrive, which timely leaves open).
    ``key`` picks the routing key from the record (default: field 0, the pair's key).
    """

    def apply(state: dict, record: Any, out: list) -> None:
        k, v = record
        new, outputs = fold(k, v, state.get(k))
        if new is None:
            state.pop(k, None)
        else:
            state[k] = new
        if outputs:
            out.extend(outputs)

    def logic(time: Any, records: list, timers: list, state: dict, notificator: Any) -> list:
        out: list = []
        for record in records:
            apply(state, record, out)
        return out

    key = _key_fn(0 if key is None else key)
    m = _build([stream], control, [key], logic, k, name, chunk, per_time=per_record_time(key, apply))
    m._shared.records_keys = True  # a record reaches only its key's entry: S tracks copied bins by records
    return m
