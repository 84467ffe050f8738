"""Replayable input and an exactly-once file sink for jobs with checkpoints.

:func:`source` reads the input epoch by epoch through a deterministic ``read(epoch, index, peers)``
and resumes at the checkpoint's epoch after a restart; :func:`sink` writes each complete epoch to
files once, however often it is replayed; :func:`read_sink` reads them back.
"""
from __future__ import annotations

import pickle
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import fsspec

from ..dataflow import Capability, Exchange, OperatorBuilder, ProbeHandle, Scope, Stream
from ..routing import hash64
from .store import CheckpointError

__all__ = ["source", "sink", "read_sink", "SLOTS"]

#: Files a sink spreads each epoch over (by a hash of the record): fixed, whatever the worker count.
SLOTS = 64

Read = Callable[[int, int, int], "Sequence[Any] | None"]


def source(scope: Scope, name: str, read: Read, max_in_flight: int = 2, probe: ProbeHandle | None = None) -> Stream:
    """A replayable input: the records of epoch ``e`` on this worker are ``read(e, index, peers)``.

    ``read`` returns the records (a list, possibly empty) of worker ``index`` of ``peers`` at
    ``epoch``, or ``None`` when the stream ended before ``epoch`` (the source then stops). It must
    be **deterministic**: after a restart the epochs from the checkpoint's on are read again and
    must give the same records (with the same ``peers``; after rescaling, the same records over
    all workers), or the recovered output is not the uninterrupted one. The source starts at
    ``worker.checkpoint.resume_epoch`` (0 without checkpoints), or earlier, at the epoch its
    stream had ended at when the checkpoint was cut (see below), and emits epoch after epoch,
    keeping at most ``max_in_flight`` epochs that ``probe`` (attach it to the end of the dataflow
    with ``stream.probe_with(probe)``, or pass :func:`sink`'s) has not seen complete; without a
    probe it emits as fast as it is scheduled. With checkpoints it is a participant named
    ``source/<name>`` that offers each checkpoint epoch (without state) when it reaches it.

    Its end is checkpointed: when ``read`` returns ``None`` at epoch ``L``, the source closes
    with meta ``{"ended": L}``, which every later checkpoint records. Other participants offer
    their last changes at the next checkpoint epoch ``C > L``, so the job's last checkpoint may
    be cut above ``L``; its state holds every input of this source (those before ``L``). A job
    continued from it (more epochs, an epoch limit raised, rescaled) resumes this source at
    ``min(C, L)``, so it reads the epochs ``L .. C - 1`` it never read (they were not in the
    state), not from ``C`` on. Where the workers' sources ended at different epochs, the latest
    of them counts (a worker whose source was still reading at the cut counts as ``C``): the
    epochs some worker read are never read again.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
    ck = scope.worker.checkpoint
    participant = None if ck is None else ck.register(f"source/{name}")
    start = 0 if ck is None or participant is None else _start(ck.resume_epoch, participant.meta())
    b = OperatorBuilder(scope, name)
    out, stream = b.new_output()
    info = b.info
    index, peers = scope.index, scope.peers
    if probe is not None:
        probe.watch(info.activator)

    def build(caps: list[Capability]) -> Callable[[], None]:
        held: list[Capability] = [caps[0]]
        held[0].downgrade(start)
        epoch = start

        def logic() -> None:
            nonlocal epoch
            # Invariant: the capability is at `epoch`, the next epoch to read; epochs before it are sent.
            while held and (probe is None or not probe.less_than(epoch - max_in_flight + 1)):
                records = read(epoch, index, peers)
                if records is None:
                    held.pop().drop()
                    if participant is not None:
                        participant.close({"ended": epoch})  # (recorded in later checkpoints: _start)
                    return
                if participant is not None and ck is not None and ck.is_checkpoint(epoch):
                    participant.offer(epoch, {})  # every epoch before it is sent: resume here
                if len(records):
                    out.give_batch(held[0], records)
                epoch += 1
                held[0].downgrade(epoch)
                if probe is None:
                    info.activator.activate()  # one epoch per activation: let the others run
                    return

        return logic

    b.build(build)
    info.activator.activate()
    return stream


def _start(resume: int, metas: dict[int, Any]) -> int:
    """The epoch a source resumes at from a checkpoint of epoch ``resume`` whose workers recorded
    ``metas`` for it (by worker): ``resume``, or the latest epoch the workers' streams had ended
    at, if every worker's had (``{"ended": L}``) and that is earlier. Invariant: the checkpoint's
    state holds no record of this source of the returned epoch or later, and every record read
    before it (all of its records before it where the workers' streams ended together)."""
    ends = []
    for meta in metas.values():
        if not (isinstance(meta, dict) and isinstance(meta.get("ended"), int)):
            return resume  # that worker's source was still reading at the cut: its records reach `resume`
        ends.append(meta["ended"])
    return min(resume, max(ends)) if ends else resume


def _slot(slots: int) -> Callable[[Any], int]:
    def slot(record: Any) -> int:
        return hash64(record) % slots

    return slot


def sink(stream: Stream, url: str, name: str, probe: ProbeHandle | None = None, slots: int = SLOTS) -> ProbeHandle:
    """Write ``stream``'s records to files under ``url`` (a directory or fsspec URL), exactly once.

    Once an epoch is complete, its records go to ``<url>/<name>/e<epoch>-s<slot>.pkl`` (pickled
    lists), one file per slot (a hash of the record, modulo ``slots``) that has records, each
    written atomically (a temporary file renamed) by the one worker its slot is routed to. A file
    that exists already (written before a crash, its epoch replayed now) is not written again, so
    a reader sees every record of an epoch once: the guarantee needs the replayed records to be
    the same (deterministic sources and operators). Returns the probe (``probe`` if given) that
    passes an epoch once every worker's files of it are written: pacing for :func:`source`.

    With checkpoints the sink is a participant named ``sink/<name>`` (without state) that offers
    checkpoint epoch ``e`` once it has written every epoch before ``e``: a checkpoint is complete
    only when the output of the epochs it will not replay is on disk (else a crash right after it
    would lose that output for good).
    """
    fs, root = fsspec.core.url_to_fs(url)
    folder = f"{root.rstrip('/')}/{name}"
    try:
        fs.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"sink '{name}': cannot create {folder}: {e}") from e
    scope = stream.scope
    b = OperatorBuilder(scope, f"Sink({name})")
    slot = _slot(slots)
    inp = b.new_input(stream, Exchange(slot))
    out, done = b.new_output()
    b.set_frontier_interest(True)
    pending: dict[Any, tuple[Capability, dict[int, list]]] = {}  # epoch -> (held capability, slot -> records)
    ck = scope.worker.checkpoint
    participant = None if ck is None else ck.register(f"sink/{name}")
    next_offer = 0 if ck is None else (ck.resume_epoch // ck.every + 1) * ck.every  # the first above the resumed one

    def write(epoch: int, part: int, records: list) -> None:
        path = f"{folder}/e{epoch:012d}-s{part:05d}.pkl"
        try:
            if fs.exists(path):
                return  # written before a restart: readers may have seen it already
            tmp = f"{folder}/.tmp-{uuid.uuid4().hex}"
            fs.pipe_file(tmp, pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL))
            fs.mv(tmp, path)
        except OSError as e:
            raise CheckpointError(f"sink '{name}': cannot write {path}: {e}") from e

    def build(caps: list[Capability]) -> Callable[[], None]:
        caps[0].drop()

        def run() -> None:
            nonlocal next_offer
            for cap, batch in inp:
                if cap.time not in pending:
                    pending[cap.time] = (cap.retain(), {})  # holds the epoch open until it is written
                by_slot = pending[cap.time][1]
                for r in batch:
                    by_slot.setdefault(slot(r), []).append(r)
            frontier = inp.frontier
            for t in sorted(t for t in pending if not frontier.less_equal(t)):
                held, by_slot = pending.pop(t)
                for part in sorted(by_slot):
                    write(t, part, by_slot[part])
                held.drop()
            if participant is not None and ck is not None and not participant.closed:
                # Invariant: every epoch before the frontier is written (above), so each checkpoint
                # epoch the frontier has reached may be offered.
                if frontier.is_empty():
                    participant.close()
                while not participant.closed and not frontier.less_than(next_offer):
                    participant.offer(next_offer, {})
                    next_offer += ck.every

        return run

    b.build(build)
    handle = probe if probe is not None else ProbeHandle()
    done.probe_with(handle)
    return handle


def read_sink(url: str, name: str) -> dict[int, list]:
    """The records :func:`sink` ``name`` wrote under ``url``, by epoch (epochs in order)."""
    fs, root = fsspec.core.url_to_fs(url)
    folder = f"{root.rstrip('/')}/{name}"
    try:
        paths = sorted(p for p in fs.ls(folder, detail=False) if p.rsplit("/", 1)[-1].startswith("e"))
    except FileNotFoundError:
        return {}
    out: dict[int, list] = {}
    for path in paths:
        epoch = int(path.rsplit("/", 1)[-1][1:13])
        try:
            out.setdefault(epoch, []).extend(pickle.loads(fs.cat_file(path)))
        except (OSError, pickle.UnpicklingError, EOFError, ValueError) as e:
            raise CheckpointError(f"sink file {path} cannot be read: {e}") from e
    return out
