"""F, the routing operator of the Megaphone paper: it routes records by the configuration in force
at their time, and ships the state of moving bins to their new owners at migration times.

Invariants of ARCHITECTURE.md section 5 relied on here: a record is routed by the table in force at its
own time, only once that table is final (5.3); a bin leaves only once S has applied every time
before the migration time (5.4).
"""
from __future__ import annotations

import time as _time
from typing import Any

from timely import Activator, Capability, Frontier, OperatorInput, OperatorOutput, ProbeHandle

from .bins import Shared
from .precopy import PreCopier
from .table import COPIES, Table, TableError, apply, canonical, moved_bins, validate_update


class RoutingOperator:
    """F: routes records by the configuration in force at their time; ships bins at migration times."""

    def __init__(self, shared: Shared, n: int, ctrl_frontier: Frontier, probe: ProbeHandle, chunk: int,
                 copied: ProbeHandle, activator: Activator) -> None:
        self.shared = shared
        self.n = n
        self.ctrl_frontier = ctrl_frontier
        self.probe = probe
        self.chunk = chunk
        self.copied = copied  # passes t0 once every copy ahead requested at t0 is staged (megaphone.precopy)
        self.activator = activator
        self.precopier = shared.precopier = PreCopier(shared)
        self.precopier.waiting = activator.work_waiting
        self.ctrl_pending: dict[Any, tuple[Any, list, Any]] = {}
        self.to_extract: list[tuple[Any, tuple, tuple, Any]] = []
        self.stash: dict[Any, tuple[list, list]] = {}  # time -> (caps per input, batches per input)

    def run(self, data_in: list[OperatorInput], ctrl_in: OperatorInput, data_out: list[OperatorOutput],
            state_out: OperatorOutput, copy_out: OperatorOutput) -> None:
        """One activation: compile configurations, ship moving bins, route or stash data, copy ahead."""
        shared = self.shared
        ctrl_frontier = self.ctrl_frontier
        # 1. Control ingest: hold a capability at each control time on the state and copy outputs.
        for cap, batch in ctrl_in:
            pending = self.ctrl_pending.get(cap.time)
            if pending is None:
                pending = self.ctrl_pending[cap.time] = (cap.retain(self.n), [], cap.retain(self.n + 1))
            pending[1].extend(batch)
        # 2. Compile configurations whose time the control frontier has passed (times total order).
        for t in sorted(self.ctrl_pending):
            if ctrl_frontier.less_equal(t):
                break
            cap, updates, copy_cap = self.ctrl_pending.pop(t)
            for u in updates:
                try:
                    validate_update(u, shared.nbins, shared.peers)
                except TableError as e:
                    raise TableError(f"'{shared.name}': {e}") from None
            for kind, b, w in sorted(u for u in updates if u[0] in COPIES):  # copy ahead (megaphone.precopy)
                self.precopier.start(b, w, copy_cap.delayed(t), copy_out, replica=kind == "replica")
            copy_cap.drop()
            updates = [u for u in updates if u[0] not in COPIES]
            if not updates:
                cap.drop()
                continue
            old = shared.config_tables[-1]
            new = apply(old, canonical(updates))  # the same table on every worker, whatever the arrival order
            shared.config_times.append(t)
            shared.config_tables.append(new)
            self.to_extract.append((t, old, new, cap))
        # 3. Ship moving bins once S has finished every time before t (ARCHITECTURE 5.4); until then the
        #    capability at t on the state output keeps S from applying anything at or after t.
        while self.to_extract and not self.probe.less_than(self.to_extract[0][0]):
            t, old, new, cap = self.to_extract.pop(0)
            self._extract(t, old, new, cap, state_out)
        # Once the control input has ended and every move is shipped, no hand-over can use a copy
        # ahead or a replica: they end here, instead of holding the dataflow open while their
        # chunks go out at the copies' pace.
        if self.precopier.copies and ctrl_frontier.is_empty() and not self.to_extract:
            self.precopier.close()
        # 4. New data: route now if the configuration at its time is final, else stash it (ARCHITECTURE 5.3).
        #    The replicas' refreshes, when due, go at the time of the first record (megaphone.precopy).
        refresh = self.precopier.refresh_due()
        routed = False
        for i, inp in enumerate(data_in):
            for cap, batch in inp:
                routed = True
                t = cap.time
                if refresh:
                    refresh = False
                    self.precopier.refresh(cap.retain(self.n + 1), self._copy_delivered)
                if ctrl_frontier.less_equal(t):
                    entry = self.stash.get(t)
                    if entry is None:
                        entry = self.stash[t] = ([None] * self.n, [[] for _ in range(self.n)])
                    if entry[0][i] is None:
                        entry[0][i] = cap.retain(i)
                    entry[1][i].append(batch)
                else:
                    data_out[i].give_batch(cap, batch)
        # 5. Release stashed data whose configuration became final.
        for t in sorted(self.stash):
            if ctrl_frontier.less_equal(t):
                break
            caps, batches = self.stash.pop(t)
            for i in range(self.n):
                if caps[i] is not None:
                    for batch in batches[i]:
                        data_out[i].give_batch(caps[i], batch)
                    caps[i].drop()
        # 6. Copy ahead for a bounded time, on an idle worker (records first); come back while
        #    copies have chunks left.
        if self.precopier.sending:
            again = self.precopier.step(copy_out, busy=routed)
            if again is not None:
                idle, latest = again
                self.activator.activate_after(idle, when_idle=True)
                if latest is not None:
                    self.activator.activate_after(latest)
        # Forget configurations no record can be routed by any more.
        # (Stashed records were consumed already: their times bound the horizon too.)
        low = [t for p in data_in for t in p.frontier] + list(self.stash)
        if low:
            horizon = min(low)
            if shared.checkpoint is not None:  # its next offer reads the table in force at its epoch
                horizon = min(horizon, shared.checkpoint.next_epoch)
            while len(shared.config_times) > 1 and shared.config_times[1] <= horizon:
                del shared.config_times[0], shared.config_tables[0]

    def _copy_delivered(self, t0: Any) -> bool:
        """True once every copy ahead requested at ``t0`` is staged on its target."""
        return not self.copied.less_equal(t0)

    def _extract(self, t: Any, old: Table, new: Table, cap: Capability, state_out: OperatorOutput) -> None:
        shared = self.shared
        me = shared.index
        if shared.checkpoint is not None:
            # Epochs before t first: their cut still holds here (S applied nothing at or after an
            # epoch it has not offered), and the bins leave now (megaphone.checkpoint).
            shared.checkpoint.offer_before(t)
        started = _time.perf_counter()
        moved = moved_bins(old, new, source=me)
        nbytes = entries = ahead = 0
        modes: dict[str, int] = {}
        codec = shared.codec
        for b in moved:
            bin_ = shared.take_bin(b)
            delta, copy, why = self.precopier.hand_over(b, bin_, new[b], self._copy_delivered)
            if copy is not None:
                ident = (copy.t0, me)
                ahead += copy.nbytes
                if delta is not None:  # only what changed since the copy ahead (megaphone.precopy)
                    state_out.give_batch(cap, [(new[b], b, delta, "delta", ident, copy.sent)])
                    nbytes += len(delta)
                    modes["delta"] = modes.get("delta", 0) + 1
                    continue
                state_out.give_batch(cap, [(copy.target, b, None, "drop", ident, copy.sent)])
                modes["fallback"] = modes.get("fallback", 0) + 1
                shared.log({"kind": "fallback", "time": t, "bins": [b], "reason": why, "worker": me})
            modes["whole"] = modes.get("whole", 0) + 1
            timers = bin_.pending_timers()
            entries += codec.size(bin_.state)
            # Bounded chunks: one state message per chunk of at most `chunk` entries; the timers
            # travel with the first.
            for i, part in enumerate(codec.chunks(bin_.state, self.chunk)):
                payload = codec.pack(part, timers if i == 0 else [])
                nbytes += codec.nbytes(payload)
                state_out.give_batch(cap, [(new[b], b, payload)])
        cap.drop()
        if moved and shared.s_activator is not None:
            shared.s_activator.activate()  # S releases the capabilities of timers that left
        if moved:
            shared.log({"kind": "extract", "time": t, "bins": moved, "to": [new[b] for b in moved],
                        "entries": entries, "bytes": nbytes, "seconds": _time.perf_counter() - started,
                        "worker": me, "ahead_bytes": ahead, "modes": modes})


class ExtractionWaker:
    """What F gives S's output probe to watch (``ProbeHandle.watch``): schedules F when that
    frontier moved, if bins wait for it (``RoutingOperator.to_extract``).

    Invariant relied on: only the extraction of moving bins (step 3 of ``RoutingOperator.run``)
    reads that frontier, and a bin joins ``to_extract`` inside ``run``, which tests the frontier at
    once. F's own inputs wake it at every epoch; waking it for S's frontier too, with nothing to
    extract, ran F a second time per epoch, in a step of its own (bench/RESULTS.md)."""

    __slots__ = ("route",)

    def __init__(self, route: RoutingOperator) -> None:
        self.route = route

    def activate(self) -> None:
        """Schedule F if it has bins to extract."""
        if self.route.to_extract:
            self.route.activator.activate()
