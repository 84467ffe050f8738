"""The checkpoint runtime of one worker: participants, per-epoch offers, the background writer, the commit.

A *checkpoint at epoch e* holds every participant's state reflecting exactly the inputs at epochs
``< e``; sources resume at ``e``, or, a source whose stream had ended at ``L < e`` (its participant
closed with meta ``{"ended": L}``, which the checkpoint records), at ``L``: the state holds none
of its records from ``L`` on, and a job continued with more input reads them (see
:func:`~timely.checkpoint.source`). Checkpoint epochs are those with ``e > 0`` and
``e % every == 0``: every worker knows them without coordination.

Per worker, participants (``ck.register(name)``, the same names on every worker, registered while
the dataflows are built) offer their changed state at each checkpoint epoch, in order. Once every
participant has offered epoch ``e`` (or has closed: its state will not change again), the worker's
part of ``e`` is handed to a background thread, which writes it with
:meth:`Store.write_part <timely.checkpoint.store.Store.write_part>` (the part file, then its pending
marker). An epoch where nothing changed (no blob offered, the same meta) writes no part: the worker
only moves its reached marker (:meth:`Store.write_reached`), once per run of such epochs, so a far
jump of the frontier costs one small write. The dataflow goes on meanwhile: an offer only blocks when
:data:`MAX_QUEUED` writes are already waiting (:meth:`Checkpointer.stats` measures both). Worker 0
checks from its step loop, at most every :data:`POLL` seconds and without blocking (the check itself
runs on the background thread), for the newest epoch every worker has reached
(:meth:`Store.committable`), and commits its manifest. An error on the background thread (a full
disk, a permission) fails the job at the worker's next step with a :class:`CheckpointError` naming
the file; the previous checkpoint stays usable, as a manifest is written only once all of its parts
are.

Job identity: every part records the shape digests of the worker's dataflows; a restart whose
dataflows have other shapes than those of the checkpoint is refused (:meth:`Checkpointer.built`).
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import EllipsisType
from typing import Any

from .store import Blob, CheckpointError, Manifest, Store

__all__ = ["CheckpointConfig", "Checkpointer", "Participant", "JOB", "POLL", "MAX_QUEUED"]

log = logging.getLogger("timely.checkpoint")

#: The ``job`` every checkpoint store is opened with: a job is told apart by its dataflows' shapes.
JOB = "timely"
#: Seconds between worker 0's checks for a committable epoch.
POLL = 0.05
#: Parts that may wait for the background writer before an offer blocks (back pressure).
MAX_QUEUED = 4
#: Seconds :meth:`Checkpointer.close` waits for a write in progress to end.
CLOSE_WAIT = 5.0
#: Seconds worker 0 waits, when the job ends, for every worker's final marker (then it makes the last commit).
FINAL_COMMIT_WAIT = 2.0
#: The key of the runtime's own entry in a part's meta (next to each participant's meta, by name).
_OWN = "_timely"
#: Test hook: seconds every part write is slowed by (environment ``TIMELY_CHECKPOINT_TEST_DELAY``).
_DELAY_ENV = "TIMELY_CHECKPOINT_TEST_DELAY"


@dataclass(frozen=True)
class CheckpointConfig:
    """Where a job's checkpoints live (``url``: a directory or an fsspec URL) and how often they
    are taken (every ``every`` epochs). Picklable: it travels to the worker processes."""

    url: str
    every: int
    attempt: int = 0  #: which run of the job this is (0, then one more per restart)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpoint_every must be at least 1 epoch, not {self.every}")


def _participants(manifest: Manifest) -> set[str]:
    """The names of the participants whose state ``manifest`` records (on any worker)."""
    return set().union(*(set(v) - {_OWN} for v in manifest.meta.values() if isinstance(v, dict)))


class Participant:
    """One registered piece of checkpointed state of one worker (see :meth:`Checkpointer.register`)."""

    def __init__(self, ck: Checkpointer, name: str) -> None:
        self._ck = ck
        self.name = name
        self.offered = ck.resume_epoch  # the last epoch offered (or resumed from)
        self.closed = False

    def restore(self, keys: Iterable[str] | None = None) -> dict[str, bytes]:
        """This participant's blobs in the checkpoint the job resumed from (all of them, or only
        ``keys``, e.g. the keys this worker owns after rescaling); ``{}`` on a fresh start."""
        m = self._ck.manifest
        return {} if m is None else self._ck.store.read(m, self.name, keys)

    def keys(self) -> list[str]:
        """The keys this participant holds in the checkpoint resumed from (every worker's)."""
        m = self._ck.manifest
        return [] if m is None else m.keys(self.name)

    def meta(self) -> dict[int, Any]:
        """The ``meta`` each worker (by index) last offered, in the checkpoint resumed from."""
        m = self._ck.manifest
        if m is None:
            return {}
        return {w: v[self.name] for w, v in m.meta.items() if isinstance(v, dict) and self.name in v}

    def offer(self, epoch: int, changed: dict[str, Blob | None], meta: Any = None) -> None:
        """Offer this participant's state at checkpoint epoch ``epoch``: the blobs of the keys changed
        since its last offer (``None`` deletes a key) and JSON-able ``meta``. A blob is bytes, or a
        callable the writer thread calls for them (the participant then keeps what it reads
        unchanged until the call, or makes the call itself first: copy on write). Every checkpoint
        epoch above the resume epoch is offered once, in order; epochs at or below
        :attr:`Checkpointer.resume_epoch` are ignored."""
        ck = self._ck
        if not ck.is_checkpoint(epoch):
            raise ValueError(f"participant '{self.name}': {epoch} is not a checkpoint epoch (every {ck.every})")
        if epoch <= ck.resume_epoch:
            return
        if self.closed or epoch <= self.offered:
            raise CheckpointError(f"participant '{self.name}' offered epoch {epoch} after epoch {self.offered}"
                                  + (" and after closing" if self.closed else ""))
        missing = (self.offered // ck.every + 1) * ck.every  # the next checkpoint epoch
        if epoch != missing:
            raise CheckpointError(f"participant '{self.name}' offered epoch {epoch} without epoch {missing}")
        self.offered = epoch
        ck._offer(self, epoch, changed, meta)

    def close(self, meta: Any = None) -> None:
        """Declare that this participant's state will not change again (its input ended): later
        checkpoints carry nothing from it. Offer the last changes first. ``meta`` (JSON-able, when
        not ``None``) replaces its meta from then on: it is in every part the worker writes after
        the close (a source records the epoch its stream ended at, :func:`~timely.checkpoint.source`),
        so in every checkpoint of an epoch the worker hands after the close."""
        if not self.closed:
            self.closed = True
            if meta is not None:
                self._ck._end_meta[self.name] = meta
            self._ck._advance()


class Checkpointer:
    """The checkpoint runtime of worker ``index`` of ``peers`` (``worker.checkpoint``).

    ``store`` holds the checkpoints; the job resumes from its newest complete manifest
    (:attr:`manifest`, :attr:`resume_epoch`), read once here, or from ``manifest`` when given
    (:meth:`open` reads it first, to name the run after it).
    """

    def __init__(self, store: Store, every: int, index: int, peers: int,
                 manifest: Manifest | None | EllipsisType = ...) -> None:
        if every < 1:
            raise ValueError(f"checkpoint every must be at least 1 epoch, not {every}")
        self.store = store
        self.every = every
        self.index = index
        self.peers = peers
        self.manifest: Manifest | None = store.latest() if manifest is ... else manifest
        self.resume_epoch: int = 0 if self.manifest is None else self.manifest.epoch
        self._participants: dict[str, Participant] = {}
        self._digests: list[str] = []
        self._offers: dict[int, dict[str, tuple[dict[str, Blob | None], Any]]] = {}
        self._meta: dict[str, Any] = {}  # each participant's meta in the newest part handed to the writer
        self._end_meta: dict[str, Any] = {}  # the meta closed participants gave close(): it replaces their offers'
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(MAX_QUEUED)
        self._closing = threading.Event()  # set by close(): the writer drops every task it has not begun
        self._error: BaseException | None = None
        self._handed: int = self.resume_epoch  # the newest epoch handed to the writer (part or reached)
        self._registered_checked = False  # _check_registered ran
        self._committed: int = self.resume_epoch  # worker 0: the newest epoch committed
        self._last_meta: Any = None  # the meta of the newest part handed to the writer
        self._reached: list[int] | None = None  # the open reached marker's epoch, while its write is queued
        self._reached_lock = threading.Lock()
        self._commit_busy = False
        self._next_poll = 0.0
        self._settled = False  # worker 0, when the job ends: every worker's final marker seen, the last commit made
        #: Every participant of this worker has closed, and its final reached marker is queued: its
        #: state changes no more, and it holds no commit back (a worker whose inputs ended first).
        self._final = False
        self._delay = float(os.environ.get(_DELAY_ENV, "0") or 0)
        self._stats = {"parts": 0, "bytes": 0, "write_s": 0.0, "write_max_s": 0.0, "offer_block_s": 0.0,
                       "offer_block_max_s": 0.0, "commits": 0, "write_cpu_s": 0.0, "commit_cpu_s": 0.0}
        self._thread = threading.Thread(target=self._writer, name=f"timely-checkpoint-{index}", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, config: CheckpointConfig, index: int, peers: int, job_id: str = "") -> Checkpointer:
        """The checkpointer of worker ``index`` of ``peers`` for ``config``. The parts of this run
        are committed only with each other: a run is named by ``job_id`` (what every worker of one
        launch shares), the number of workers, the attempt and the checkpoint it resumes from (its
        epoch and creation stamp), so the pending parts a failed run left behind never join (they
        are collected once a newer checkpoint covers their epoch). ``job_id`` comes from the job's
        token, which a user may fix (``--token``, ``TIMELY_TOKEN``) and reuse: the number of workers
        keeps a rescaled launch from the markers of the earlier launch's extra workers (it never
        committed), and the resumed checkpoint keeps a launch from the leftover parts of an earlier
        launch with as many workers (2, then 3, then 2 workers: the first launch's uncommitted part
        of worker 0 joined the third's commit). Only a launch that repeats an earlier one exactly
        (token, workers, attempt and checkpoint) shares its name: its parts are the same state.

        A process-local file system (fsspec ``memory://``) with more than one worker is refused
        (:class:`CheckpointError`): every worker is a process of its own, with a file system of its
        own, so no worker would see the others' parts and no checkpoint would ever commit."""
        store = Store(config.url, JOB)
        if peers > 1 and store.process_local:
            raise CheckpointError(
                f"checkpoint storage {config.url!r} is local to each process (fsspec protocol "
                f"{store.fs.protocol!r}): each of the {peers} worker processes would write to a file system of its "
                "own, so no checkpoint would ever be complete; use a directory or a URL every worker reaches")
        manifest = store.latest()
        resumed = "start" if manifest is None else f"{manifest.epoch}@{manifest.created!r}"
        run = f"{job_id}/{peers}/{config.attempt}/{resumed}"
        return cls(Store(config.url, JOB, run=run), config.every, index, peers, manifest)

    # -- the job's side --------------------------------------------------------------------------
    def is_checkpoint(self, epoch: int) -> bool:
        """True if ``epoch`` is a checkpoint epoch (``> 0`` and a multiple of :attr:`every`)."""
        return epoch > 0 and epoch % self.every == 0

    def register(self, name: str) -> Participant:
        """A new participant named ``name`` (registered while building, the same names on every
        worker). Restarting from a checkpoint whose workers registered other names is refused."""
        if name in self._participants:
            raise CheckpointError(f"checkpoint participant '{name}' registered twice")
        if self._final:
            raise CheckpointError(
                f"checkpoint participant '{name}' registered on worker {self.index} after every earlier participant "
                "had closed, which declared the worker's state final; checkpoints cover the dataflows built "
                "before the first one's inputs end")
        if self._handed > self.resume_epoch:
            # Its offers would start at the first checkpoint epoch past the resume epoch, which the
            # worker has already handed (and worker 0 may have committed) without it: its state
            # would be missing from every checkpoint, silently.
            raise CheckpointError(
                f"checkpoint participant '{name}' registered on worker {self.index} after the worker had handed "
                f"checkpoint epoch {self._handed} without it; build every dataflow that checkpoints before the "
                "first checkpoint epoch passes (before stepping the ones built earlier that far)")
        m = self.manifest
        if m is not None:
            known = _participants(m)
            if name not in known:
                raise CheckpointError(f"checkpoint {m.path} belongs to another job: it has no participant '{name}' "
                                      f"(it has {sorted(known)}); use another checkpoint directory")
        p = Participant(self, name)
        self._participants[name] = p
        self._meta[name] = None
        return p

    def built(self, name: str, digest: int) -> None:
        """Called when a dataflow is built: refuse a checkpoint whose dataflow at the same position
        had another shape (another job)."""
        position = len(self._digests)
        self._digests.append(f"{digest:016x}")
        m = self.manifest
        if m is None:
            return
        recorded = (m.meta.get(0) or {}).get(_OWN, {}).get("dataflows", [])
        if position < len(recorded) and recorded[position] != self._digests[-1]:
            raise CheckpointError(f"checkpoint {m.path} belongs to another job: dataflow '{name}' (number {position}) "
                                  f"has shape {self._digests[-1]}, the checkpoint's {recorded[position]}; "
                                  f"use another checkpoint directory")

    def _check_registered(self) -> None:
        """Once this worker's participants are final (it handed an epoch, after which none may
        register, or the job ends): refuse a checkpoint with participants this job does not
        register, another job's (``register`` refuses names the checkpoint lacks; this, the
        names the job lacks)."""
        if self._registered_checked:
            return
        self._registered_checked = True
        m = self.manifest
        if m is None:
            return
        missing = sorted(_participants(m) - set(self._participants))
        if missing:
            raise CheckpointError(f"checkpoint {m.path} belongs to another job: it has participants {missing}, which "
                                  f"this job does not register (it registers {sorted(self._participants)}); use another "
                                  "checkpoint directory")

    def stats(self) -> dict[str, float]:
        """Counters: ``parts`` written and their ``bytes``, ``write_s`` / ``write_max_s`` (time spent
        writing, on the background thread) and ``write_cpu_s`` (its CPU), ``offer_block_s`` /
        ``offer_block_max_s`` (time the dataflow was held by offers), ``commits`` and
        ``commit_cpu_s`` (worker 0)."""
        return dict(self._stats)

    # -- the worker's side -------------------------------------------------------------------------
    def poll(self) -> None:
        """From the worker's step loop: raise a background error; on worker 0, schedule a commit check
        at most every :data:`POLL` seconds. Never blocks."""
        if self._error is not None:
            raise self._error
        if not self._registered_checked and self._handed > self.resume_epoch:
            self._check_registered()  # (before worker 0 schedules the first commit)
        # (worker 0 final: the others' epochs still commit, though its own no longer move)
        if self.index != 0 or self._commit_busy or self._handed <= self._committed and not self._final:
            return
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + POLL
        # Busy before the commit is queued: the writer thread may run it to its end (which clears
        # the flag) before put_nowait returns, and a flag set afterwards would stay set for good.
        self._commit_busy = True
        try:
            self._queue.put_nowait(self._try_commit)
        except queue.Full:
            self._commit_busy = False

    def flush(self) -> None:
        """When the job ends: write the parts offered so far and the final marker, wait for them
        (worker 0: and, up to :data:`FINAL_COMMIT_WAIT` seconds, for every worker's final marker,
        then it makes the last commit); raise a background error."""
        self._check_registered()
        self._advance(final=True)
        self._queue.put(functools.partial(self.store.write_reached, self.index, self._handed, True))
        self._queue.join()
        deadline = time.monotonic() + FINAL_COMMIT_WAIT
        # Worker 0 waits for the others' final markers, not only for its own epochs: the last
        # epochs may be the others' alone (worker 0's inputs ended first), and their final markers
        # may come after its last commit check of the run.
        while self.index == 0 and not self._settled and self._error is None and time.monotonic() < deadline:
            self._queue.put(self._final_commit)
            self._queue.join()
            if not self._settled:
                time.sleep(POLL / 2)
        self._queue.join()
        if self._error is not None:
            raise self._error
        log.debug("worker %d checkpoint stats: %s", self.index, self._stats)

    def close(self) -> None:
        """Stop the background thread: the writes and commit checks still queued are dropped (a
        write already begun is finished; :meth:`flush` first writes everything). Waits up to
        :data:`CLOSE_WAIT` seconds for the thread, which ends after that write in any case. Idempotent."""
        if not self._thread.is_alive():
            return
        self._closing.set()  # (the writer runs no task from now on)
        while True:
            try:
                while True:  # drop the queued tasks
                    self._queue.get_nowait()
                    self._queue.task_done()
            except queue.Empty:
                pass
            try:
                self._queue.put_nowait(None)
                break
            except queue.Full:  # (only with tasks queued by another thread meanwhile: drop them too)
                continue
        self._thread.join(CLOSE_WAIT)

    # -- internals --------------------------------------------------------------------------------
    def _offer(self, p: Participant, epoch: int, changed: dict[str, Blob | None], meta: Any) -> None:
        self._offers.setdefault(epoch, {})[p.name] = (changed, meta)
        self._advance()

    def _advance(self, final: bool = False) -> None:
        """Hand every epoch all participants have offered (or closed before) to the writer, in order.
        ``final``: the job ended, so every participant is done."""
        live = [p for p in self._participants.values() if not p.closed]
        while self._offers:
            epoch = min(self._offers)
            if not final and any(p.offered < epoch for p in live):
                return
            offers = self._offers.pop(epoch)
            states = {name: changed for name, (changed, _) in offers.items()}
            self._meta.update({name: meta for name, (_, meta) in offers.items()})
            meta = self._part_meta()
            self._handed = epoch
            if meta == self._last_meta and not any(states.values()):
                # Nothing changed since the newest part: move the reached marker instead. Invariant
                # (the committer relies on it): a reached marker is written only after every part of an
                # earlier epoch, so an open marker is extended only until the next part is queued.
                with self._reached_lock:
                    if self._reached is not None:
                        self._reached[0] = epoch
                        continue
                    self._reached = [epoch]
                task: Callable[[], None] = functools.partial(self._write_reached, self._reached)
            else:
                with self._reached_lock:
                    self._reached = None
                self._last_meta = meta
                task = functools.partial(self._write, epoch, states, meta)
            began = time.monotonic()
            self._queue.put(task)
            blocked = time.monotonic() - began
            self._stats["offer_block_s"] += blocked
            self._stats["offer_block_max_s"] = max(self._stats["offer_block_max_s"], blocked)
        if not live and self._participants and not self._final and not final:
            # Every participant closed and every offer is handed: this worker's state changes no
            # more. A final reached marker (after its parts, in queue order) lets the other
            # workers' epochs commit; otherwise they would wait for this worker until the job ends.
            self._final = True
            meta, last = self._part_meta(), self._last_meta or {}
            if any(last.get(name) != value for name, value in self._end_meta.items()):
                # A participant closed with meta since the newest part (a source's end epoch): a
                # last part, without state, carries it at the next checkpoint epoch, where the
                # worker's state is what it is now (every participant offered its last changes
                # before closing). Else a checkpoint cut above the worker's newest part, where
                # the other workers went on, would lack the meta (a resumed source would skip the
                # epochs from its end on).
                epoch = (self._handed // self.every + 1) * self.every
                self._handed = epoch
                with self._reached_lock:
                    self._reached = None
                self._last_meta = meta
                self._queue.put(functools.partial(self._write, epoch, {}, meta))
            self._queue.put(functools.partial(self.store.write_reached, self.index, self._handed, True))

    def _part_meta(self) -> dict[str, Any]:
        """The meta of this worker's next part: each participant's newest (a closed one's from
        ``close``, which replaces its offers'), and the runtime's own."""
        return {**self._meta, **self._end_meta, _OWN: {"dataflows": list(self._digests), "peers": self.peers}}

    def _writer(self) -> None:
        """The background thread: run queued writes and commit checks, one at a time, in order."""
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                if self._error is None and not self._closing.is_set():
                    task()
            except CheckpointError as e:
                self._error = e
            except Exception as e:
                self._error = CheckpointError(f"checkpoint storage {self.store.url} failed: {type(e).__name__}: {e}")
            finally:
                self._queue.task_done()

    def _write(self, epoch: int, states: dict[str, dict[str, Blob | None]], meta: dict) -> None:
        began, cpu = time.monotonic(), time.thread_time()
        if self._delay:
            time.sleep(self._delay)
        record = self.store.write_part(epoch, self.index, states, meta)
        took = time.monotonic() - began
        self._stats["write_cpu_s"] += time.thread_time() - cpu
        size = sum(ref[1] for entries in record["states"].values() for ref in entries.values() if ref is not None)
        s = self._stats
        s["parts"] += 1
        s["bytes"] += size
        s["write_s"] += took
        s["write_max_s"] = max(s["write_max_s"], took)
        log.debug("worker %d: part of epoch %d written (%d bytes, %.3f s)", self.index, epoch, size, took)

    def _write_reached(self, reached: list[int]) -> None:
        with self._reached_lock:
            if self._reached is reached:
                self._reached = None  # later empty epochs queue a marker write of their own
            epoch = reached[0]
        self.store.write_reached(self.index, epoch)

    def _final_commit(self) -> None:
        """Worker 0, on the background thread, once the job ended: commit the newest epoch every
        worker reached (if newer than the newest manifest); settled once every worker's final
        marker was written before that (:meth:`Store.ended`), so the commit was the last one."""
        ended = self.store.ended(self.peers)  # (before the commit lists the markers: it sees them all)
        self._try_commit()
        self._settled = ended

    def _try_commit(self) -> None:
        """Worker 0, on the background thread: commit the newest epoch every worker has reached."""
        try:
            found = self.store.committable(self.peers)
            if found is None:
                return
            epoch, parts = found
            cpu = time.thread_time()
            manifest = self.store.commit(epoch, self.peers, parts)
            self._stats["commit_cpu_s"] += time.thread_time() - cpu
            self._committed = epoch
            self._stats["commits"] += 1
            log.debug("checkpoint of epoch %d committed (%s)", epoch, manifest.path)
        finally:
            self._commit_busy = False
