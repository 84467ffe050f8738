"""Megaphone's bins as checkpoint participants (:mod:`timely.checkpoint`).

Every S operator of a job with checkpoints (``worker.checkpoint`` not None) registers one
participant, named ``megaphone/<operator name>`` on every worker. At each checkpoint epoch ``e``
it offers its *dirty* bins, keys ``"bin/<b>"``, each value the bin's state and pending timers as
bytes of the operator's :class:`~megaphone.bins.StateCodec` (:meth:`~megaphone.bins.StateCodec.dumps`),
serialised by the checkpoint's writer thread, or by S just before it changes a bin still waiting
(copy on write, :class:`BinDump`), so an offer does not stall the dataflow for every dirty bin.
Where the operator knows which state keys changed (``state_machine``: its records' keys) and they
are few (at most a quarter of the bin), a bin goes as a *delta* instead, key ``"bin/<b>/d<slot>"``:
the changed keys' values, the deleted keys and the bin's pending timers, slots filled in order after
a whole write. Whole rewrites take turns: checkpoint number ``n`` rewrites whole the bins with
``b % P == n % P`` (``P = min(MAX_DELTAS, bins)``), so every checkpoint rewrites about ``1/P`` of the
state; a bin whose chain already holds ``P - 1`` deltas is written whole too (it may change only at
checkpoints that are not its turn), so a bin has fewer than ``P`` deltas, all of which a restore
reads; a whole write deletes the bin's slots (all of them when another worker may have written them:
a bin that moved in is always written whole first). A restore applies a bin's deltas to its whole
state in epoch order;
worker 0 adds the routing table in force at ``e`` to the offer's meta. At start from a checkpoint
each worker loads only the bins it owns, under the checkpoint's table (same worker count) or a
balanced one (rescaling), and F starts with that table, as does a :class:`~megaphone.Controller` on the
operator's :class:`~megaphone.ControlInput` (its ``initial``: :func:`megaphone.operators._restored_control`).

The cut (relied on by :meth:`BinCheckpoint.offer_before` and its three callers). The offer of epoch
``e`` on a worker holds the bins that the table in force at ``e`` gives this worker, with the
state of every time before ``e`` and nothing of a later time; bins migrating at ``e`` itself are
the new owner's, installed before it offers ``e``. Every bin is offered by one worker per epoch
(the one ``table_at(e)`` names), so the manifest's global key map gets it exactly once; the old
owner of a moved bin never deletes its key (the key is the bin's, not the worker's), and the new
owner offers it, as dirty, at the first epoch it owns it. Epoch ``e`` is offered:

* by S before it applies a time ``t >= e`` (every time before ``e`` is applied: ARCHITECTURE 5.5;
  S's inputs have passed ``t``, so every configuration up to ``e`` is compiled and its state
  installed: 5.4);
* by S once all its inputs have passed ``e`` (the same, without a time to apply);
* by F before it extracts bins at a migration time ``m > e`` (its probe shows every time before
  ``m`` applied and installed everywhere, 5.4; nothing at or after ``e`` was applied here, or S
  would have offered ``e`` first).
A bin this worker holds but does not own at ``e`` (it arrived later, before a lagging offer) stays
dirty for a later epoch.
"""
from __future__ import annotations

import pickle
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .bins import Bin, Shared
from .table import Table, TableError, balanced, validate_table

if TYPE_CHECKING:
    from timely.checkpoint import Checkpointer, Manifest
    from timely.checkpoint.store import Blob

#: Participant names handed out per checkpointer (two operators of one name get ``#2``, ...).
_NAMES: weakref.WeakKeyDictionary[Checkpointer, set[str]] = weakref.WeakKeyDictionary()


#: Deltas a bin may have on top of its whole state: each checkpoint rewrites whole the bins whose
#: turn it is, 1 in ``min(MAX_DELTAS, bins)``.
MAX_DELTAS = 32


def bin_key(b: int) -> str:
    """The checkpoint key of bin ``b``'s whole state."""
    return f"bin/{b}"


def delta_key(b: int, slot: int) -> str:
    """The checkpoint key of delta ``slot`` of bin ``b`` (slots fill in order after a whole write)."""
    return f"bin/{b}/d{slot}"


def _participant_name(ck: Checkpointer, name: str) -> str:
    """``megaphone/<name>``, made unique among this checkpointer's Megaphone participants in build
    order (the same on every worker, since every worker builds the same dataflows)."""
    taken = _NAMES.setdefault(ck, set())
    base = candidate = f"megaphone/{name}"
    n = 1
    while candidate in taken:
        n += 1
        candidate = f"{base}#{n}"
    taken.add(candidate)
    return candidate


class BinDump:
    """A bin at a checkpoint's cut (whole, or the delta of ``keys`` at epoch ``epoch``), serialised
    on first call: by the checkpoint's writer thread, or by S on the dataflow thread just before it
    changes the bin (copy on write, :meth:`Shared.thaw`). So an offer does not stall the dataflow
    for every dirty bin: the bins are serialised one at a time in the background, and only a bin
    touched before its turn is serialised on the dataflow thread. Invariant: between the offer and
    the call, nothing changes the bin's state object (every change goes through ``thaw`` first)."""

    __slots__ = ("shared", "b", "state", "timers", "epoch", "keys", "blob", "lock")

    def __init__(self, shared: Shared, b: int, state: Any, timers: list, epoch: int = 0,
                 keys: set | None = None) -> None:
        self.shared = shared
        self.b = b
        self.state = state
        self.timers = timers  # a copy already (pending_timers)
        self.epoch = epoch
        self.keys = keys
        self.blob: bytes | None = None
        self.lock = threading.Lock()

    def __call__(self) -> bytes:
        """The bin's bytes, serialised on the first call and kept (the same bytes on every call)."""
        with self.lock:
            if self.blob is None:
                state, keys = self.state, self.keys
                if keys is None:
                    self.blob = self.shared.codec.dumps(state, self.timers)
                else:
                    self.blob = pickle.dumps((self.epoch, {k: state[k] for k in keys if k in state},
                                              [k for k in keys if k not in state], self.timers),
                                             protocol=pickle.HIGHEST_PROTOCOL)
                self.state = None  # the bin may change from now on
                frozen = self.shared.frozen
                if frozen.get(self.b) is self:
                    del frozen[self.b]
            return self.blob


class BinCheckpoint:
    """One S operator's participant: tracks the dirty bins, offers them at checkpoint epochs, and
    restores the bins this worker owns at start (see the module documentation)."""

    def __init__(self, shared: Shared, ck: Checkpointer) -> None:
        self.shared = shared
        self.every: int = ck.every
        self.name = _participant_name(ck, shared.name)
        self.participant = ck.register(self.name)
        resume = int(ck.resume_epoch or 0)
        self.next_epoch = (resume // self.every + 1) * self.every  # the next epoch to offer
        self.timers: list[tuple[int, Any, Any]] = []  # restored (bin, time, payload), for S to hold
        self.closed = False
        shared.dirty = set()
        shared.changed = {}
        self.chain: dict[int, int] = {}  # bin -> deltas written since its whole state (bins whose chain this worker knows)
        #: True once the bins were restored from a checkpoint: F's first table (``shared.config_tables[0]``)
        #: is then the restored one, which the control input's controller must start from too.
        self.restored = False
        if resume > 0 and ck.manifest is not None:
            self._restore(ck.manifest)
            self.restored = True

    # -- offers --------------------------------------------------------------------------------

    def offer_before(self, limit: Any) -> None:
        """Offer every checkpoint epoch below ``limit`` not offered yet, in order. The caller
        guarantees the cut of each (module documentation): every time before the epoch applied
        and installed here, nothing at or after it applied."""
        while self.next_epoch < limit:
            self._offer(self.next_epoch)
            self.next_epoch += self.every

    def offer_passed(self, frontiers: Sequence[Any]) -> None:
        """Offer the epochs that all of S's input ``frontiers`` have passed; once they are all empty
        (the inputs ended, every time applied), offer the bins changed since the last offer at the
        next checkpoint epoch and close the participant: its bins change no more."""
        low = [t for f in frontiers for t in f]
        if low:
            self.offer_before(min(low))
        elif not self.closed:
            # The inputs ended: the bins changed since the last offer go out at the next checkpoint
            # epoch (their state reflects every input by then) before the close. A closed
            # participant's last offer is taken as its final state, so changes not offered were
            # missing from every later checkpoint while another dataflow went on.
            if self.shared.dirty:
                self.offer_before(self.next_epoch + 1)
            self.closed = True
            self.participant.close()

    def _offer(self, e: int) -> None:
        shared = self.shared
        assert shared.dirty is not None
        me = shared.index
        table = shared.table_at(e)  # final: every configuration up to e is compiled (module doc)
        bins = shared.bins
        # A dirty bin held here but another worker's at e arrived after e: it stays dirty.
        offered = [b for b in sorted(shared.dirty) if table[b] == me and bins[b] is not None]
        changed: dict[str, Blob | None] = {}
        keys_changed = shared.changed if shared.changed is not None else {}
        period = min(MAX_DELTAS, shared.nbins)
        for b in offered:
            bin_ = bins[b]
            assert bin_ is not None
            keys = keys_changed.pop(b, None)
            used = self.chain.get(b)
            # Whole rewrites take turns: bin b's turn is every checkpoint number n with n = b mod
            # period, so each checkpoint rewrites 1/period of the bins (not all of them at once after
            # the first checkpoint wrote them all). A bin that changes only at checkpoints that are
            # not its turn would never be rewritten whole by turns alone, so a chain that already
            # holds period - 1 deltas is written whole as well. Invariant relied on by _restore: a
            # bin has fewer than period <= MAX_DELTAS deltas, in slots 0 .. period - 2, so the
            # restore, which reads slots 0 .. MAX_DELTAS - 1, reads every delta written.
            turn = (e // self.every) % period == b % period
            shared.thaw(b)  # the writer lags a whole checkpoint behind: the older dump first
            if (keys is not None and used is not None and not turn and used < period - 1
                    and len(keys) * 4 <= len(bin_.state)):
                # A delta: only the keys changed since the last offer (state_machine's records say which).
                changed[delta_key(b, used)] = shared.frozen[b] = BinDump(shared, b, bin_.state,
                                                                         bin_.pending_timers(), e, keys)
                self.chain[b] = used + 1
                continue
            changed[bin_key(b)] = shared.frozen[b] = BinDump(shared, b, bin_.state, bin_.pending_timers())
            # A whole bin replaces its deltas (every slot where another worker may have written them).
            for slot in range(MAX_DELTAS if used is None else used):
                changed[delta_key(b, slot)] = None
            self.chain[b] = 0
        shared.dirty.difference_update(offered)
        meta: dict[str, Any] = {"k": shared.k, "peers": shared.peers}
        if me == 0:
            meta["table"] = list(table)
        self.participant.offer(e, changed, meta)

    # -- restore -------------------------------------------------------------------------------

    def _restore(self, manifest: Manifest) -> None:
        """Load the bins this worker owns under the restored table; F starts with that table."""
        shared = self.shared
        table = self._restored_table(manifest)
        shared.config_tables[0] = table
        codec = shared.codec
        mine = [b for b, w in enumerate(table) if w == shared.index]
        wanted = [bin_key(b) for b in mine] + [delta_key(b, slot) for b in mine for slot in range(MAX_DELTAS)]
        blobs = self.participant.restore(keys=wanted)
        bins: list[Bin | None] = [None] * shared.nbins
        for b in mine:
            bin_ = bins[b] = Bin(codec.empty())
            blob = blobs.get(bin_key(b))
            timers: list = []
            if blob is not None:
                bin_.state, timers = codec.loads(blob)
                self.chain[b] = 0
            deltas = sorted(pickle.loads(blobs[delta_key(b, slot)]) for slot in range(MAX_DELTAS)
                            if delta_key(b, slot) in blobs)
            for _epoch, updates, deleted, timers in deltas:  # in epoch order; the last one's timers hold
                bin_.state.update(updates)
                for k in deleted:
                    bin_.state.pop(k, None)
            if deltas:
                self.chain[b] = len(deltas)
            self.timers += [(b, t, p) for t, p in timers]
        shared.bins = bins

    def left(self, b: int) -> None:
        """Bin ``b`` left this worker: the next owner writes it whole."""
        self.chain.pop(b, None)

    def _restored_table(self, manifest: Manifest) -> Table:
        """The routing table to restore (the checkpoint's, or a balanced one when rescaling). A
        checkpoint with another number of bins, or with a table unfit for them, is another job's
        (or damaged): a :class:`~timely.checkpoint.CheckpointError`, which recovery does not retry."""
        from timely.checkpoint.store import CheckpointError  # (loaded already: ck is a Checkpointer)

        shared = self.shared
        meta = self.participant.meta().get(0) or {}  # worker 0's, which has the table
        k = meta.get("k", shared.k)
        if k != shared.k:
            raise CheckpointError(f"checkpoint {manifest.path} belongs to another job: Megaphone operator "
                                  f"'{shared.name}' has 2^{shared.k} bins (k={shared.k}), the checkpoint's 2^{k} "
                                  f"(k={k}); use another checkpoint directory")
        if manifest.peers != shared.peers or "table" not in meta:
            return balanced(shared.nbins, shared.peers)  # rescaling: spread the bins over the new workers
        try:
            return validate_table(meta["table"], shared.nbins, shared.peers, "checkpointed")
        except TableError as e:
            raise CheckpointError(f"checkpoint {manifest.path}: Megaphone operator '{shared.name}': {e}") from None
