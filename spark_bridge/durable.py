"""The bridge's state across a cluster failure, for jobs with checkpoints (``worker.checkpoint``).

Source side, :class:`CommitLog`: every worker appends each committed epoch of a source (the
decision and the Arrow batches it staged for the winning attempts) to a durable file under the
checkpoint URL, ``<url>/spark/<source>/w<worker>/e<epoch>.log``, before it emits the epoch. Spark's
commit reply waits for every worker to emit the epoch, so a batch Spark was told is committed is
logged by every worker. After a restart from the checkpoint at epoch ``R`` the source replays the
logged epochs ``R, R+1, ...`` that every worker logged (the *complete* prefix; a later epoch some
worker did not log was never acknowledged, and its number is reused), and worker 0's ledger
knows their batches, so Spark retrying such a commit is answered as a duplicate. The ledger of
committed batches before ``R`` is checkpoint state (participant ``spark/<source>``): every batch of
a batch-write query, and the newest batch of a streaming query (the rest are below its watermark),
so a checkpoint does not grow with a streaming query's age. Log files of epochs a committed
checkpoint covers are deleted.

Sink side, :class:`SinkDurability`: a sink is a participant (``spark-sink/<sink>``) that offers,
at each checkpoint epoch ``c``, the Arrow IPC of its complete epochs ``< c`` no reader has
released (those are not recomputed after a restart from ``c``), and restores them at start. A
reader's release point is written durably before the release is answered
(``<url>/spark-sink/<sink>/released-w<worker>``), so an epoch a reader released is never served
again, even when a restart recomputes it.
"""
from __future__ import annotations

import json
import os
import struct
import uuid
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from timely.checkpoint import CheckpointError

from .ledger import Entry

__all__ = ["CommitLog", "Logged", "SourceDurability", "SinkDurability", "encode", "decode", "ledger_blobs",
           "ledger_entries"]

MAGIC = b"TSPKLOG1"
_LEN = struct.Struct("<I")
Frames = list  # [(rows, bytes-like or ZeroMQ frame)]


# -- the file format: MAGIC, header length, JSON header, schema, frames -----------------------------
def encode(meta: dict, schema: bytes | None, frames: Frames) -> list:
    """The chunks of one file holding ``meta`` (JSON-able), an Arrow schema and frames ``(rows, body)``."""
    bodies = [getattr(f[1], "buffer", f[1]) for f in frames]  # a ZeroMQ frame's memory
    crc = zlib.crc32(schema or b"")
    for b in bodies:
        crc = zlib.crc32(memoryview(b).cast("B"), crc)
    header = json.dumps({**meta, "schema": len(schema or b""), "rows": [int(f[0]) for f in frames],
                         "lengths": [memoryview(b).nbytes for b in bodies], "crc": crc}).encode()
    return [MAGIC, _LEN.pack(len(header)), header, schema or b"", *bodies]


def decode(blob: bytes, path: str) -> tuple[dict, bytes | None, Frames]:
    """``(meta, schema, frames)`` of a file written from :func:`encode`; a corrupt one raises a
    :class:`CheckpointError` naming ``path``."""
    try:
        if blob[:len(MAGIC)] != MAGIC:
            raise ValueError("not a spark_bridge log file")
        at = len(MAGIC) + _LEN.size
        (n,) = _LEN.unpack_from(blob, len(MAGIC))
        meta = json.loads(blob[at:at + n])
        at += n
        view = memoryview(blob)
        schema = bytes(view[at:at + meta["schema"]]) or None
        at += meta["schema"]
        frames, crc = [], zlib.crc32(schema or b"")
        for rows, length in zip(meta["rows"], meta["lengths"]):
            body = view[at:at + length]
            crc = zlib.crc32(body, crc)
            frames.append((rows, body))
            at += length
        if at != len(blob) or crc != meta["crc"]:
            raise ValueError("truncated or checksum mismatch")
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise CheckpointError(f"spark_bridge file {path} is corrupt: {e}; remove it (and restart from "
                              f"another checkpoint directory if it holds committed data)") from e
    return meta, schema, frames


def _write_atomic(fs: Any, path: str, chunks: Iterable[Any]) -> None:
    """``chunks`` at ``path``, all or nothing (a temporary file renamed), durable when this returns."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        if isinstance(fs, LocalFileSystem):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                for c in chunks:
                    f.write(c)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            fs.pipe_file(path, b"".join(bytes(c) for c in chunks))  # one PUT: never half an object
    except OSError as e:
        raise CheckpointError(f"spark_bridge cannot write {path}: {e}") from e


def _epoch_of(name: str) -> int | None:
    base = name.rsplit("/", 1)[-1]
    return int(base[1:-4]) if base.startswith("e") and base.endswith(".log") and base[1:-4].isdigit() else None


class Logged:
    """One complete logged epoch: its decision and, per old worker, where its file is."""

    def __init__(self, epoch: int, meta: dict, paths: dict[int, str]) -> None:
        self.epoch = epoch
        self.query: str = meta["query"]
        self.batch: int = meta["batch"]
        self.final: bool = meta["final"]
        self.total: int = meta["total"]
        self.paths = paths

    @property
    def entry(self) -> Entry:
        """The ledger entry of this epoch's batch."""
        return (self.query, self.batch, self.final, self.epoch)


class CommitLog:
    """The committed-epoch log of source ``name`` on worker ``index`` of ``peers`` (under ``fs:root``)."""

    def __init__(self, fs: Any, root: str, name: str, index: int, peers: int) -> None:
        self.fs = fs
        self.folder = f"{root.rstrip('/')}/spark/{name}"
        self.index = index
        self.peers = peers

    def _dir(self, worker: int) -> str:
        return f"{self.folder}/w{worker:05d}"

    def path(self, worker: int, epoch: int) -> str:
        """The log file of ``worker``'s share of ``epoch``."""
        return f"{self._dir(worker)}/e{epoch:012d}.log"

    def append(self, epoch: int, record: tuple, schema: bytes | None, frames: Frames) -> None:
        """Log this worker's rows of the commit ``record`` published at ``epoch`` (durable on return).
        Every worker logs every committed epoch, with or without rows."""
        _, query, batch, tokens, final = record
        total = sum(int(r) for _, per in tokens for _, r in per)
        meta = {"epoch": epoch, "worker": self.index, "peers": self.peers, "query": query, "batch": batch,
                "final": bool(final), "total": total}
        _write_atomic(self.fs, self.path(self.index, epoch), encode(meta, schema, frames))

    def _workers(self) -> dict[int, dict[int, str]]:
        """Every worker directory's log files: worker -> epoch -> path."""
        try:
            dirs = self.fs.ls(self.folder, detail=False)
        except FileNotFoundError:
            return {}
        out: dict[int, dict[int, str]] = {}
        for d in dirs:
            base = d.rstrip("/").rsplit("/", 1)[-1]
            if base.startswith("w") and base[1:].isdigit():
                files = {e: p for p in self.fs.ls(d, detail=False) if (e := _epoch_of(p)) is not None}
                out[int(base[1:])] = files
        return out

    def _meta(self, path: str) -> dict:
        with self.fs.open(path, "rb") as f:
            head = f.read(len(MAGIC) + _LEN.size)
            if head[:len(MAGIC)] != MAGIC or len(head) < len(MAGIC) + _LEN.size:
                raise CheckpointError(f"spark_bridge file {path} is corrupt: not a spark_bridge log file")
            (n,) = _LEN.unpack_from(head, len(MAGIC))
            try:
                return json.loads(f.read(n))
            except ValueError as e:
                raise CheckpointError(f"spark_bridge file {path} is corrupt: {e}") from e

    def committed(self, since: int) -> list[Logged]:
        """The complete logged epochs ``since, since+1, ...``: every worker of the run that logged
        worker 0's file logged the same decision (a run with another worker count included)."""
        workers = self._workers()
        out: list[Logged] = []
        epoch = since
        while epoch in workers.get(0, {}):
            first = self._meta(workers[0][epoch])
            decision = (first["query"], first["batch"], first["final"])
            paths = {0: workers[0][epoch]}
            for w in range(1, first["peers"]):
                p = workers.get(w, {}).get(epoch)
                if p is None:
                    return out
                m = self._meta(p)
                if (m["query"], m["batch"], m["final"]) != decision or m["peers"] != first["peers"]:
                    return out
                paths[w] = p
            out.append(Logged(epoch, first, paths))
            epoch += 1
        return out

    def frames(self, logged: Logged) -> tuple[bytes | None, Frames]:
        """This worker's rows of a logged epoch: the files of the old workers ``w`` with
        ``w % peers == index`` (its own, unless the job was rescaled); each checked."""
        schema, frames = None, []
        for w, path in sorted(logged.paths.items()):
            if w % self.peers != self.index:
                continue
            try:
                blob = self.fs.cat_file(path)
            except OSError as e:
                raise CheckpointError(f"spark_bridge log {path} cannot be read: {e}") from e
            _, s, fs = decode(blob, path)
            schema = schema or s
            frames.extend(fs)
        return schema, frames

    def truncate(self, below: int) -> None:
        """Delete the log files of epochs before ``below`` (covered by a committed checkpoint) in
        this worker's directories (its own, and those of old workers it replays)."""
        for w, files in self._workers().items():
            if w % self.peers != self.index:
                continue
            for epoch, path in files.items():
                if epoch < below:
                    try:
                        self.fs.rm_file(path)
                    except OSError:
                        pass  # deleted next time


# -- the ledger of committed batches as checkpoint state -------------------------------------------
def ledger_blobs(entries: Iterable[Entry], queries: set[str]) -> dict[str, bytes | None]:
    """The checkpoint blobs (key ``q/<query>``) of ``queries``, from every committed ``entries``."""
    by_query: dict[str, dict] = {q: {"final": False, "batches": {}} for q in queries}
    for query, batch, final, epoch in entries:
        if query in by_query:
            by_query[query]["final"] = final
            by_query[query]["batches"][str(batch)] = epoch
    return {f"q/{q}": json.dumps(v, sort_keys=True).encode() for q, v in by_query.items()}


def ledger_entries(blobs: dict[str, bytes]) -> Iterator[Entry]:
    """The committed entries held in checkpoint blobs from :func:`ledger_blobs`."""
    for key, blob in blobs.items():
        body = json.loads(blob)
        for batch, epoch in body["batches"].items():
            yield key[2:], int(batch), bool(body["final"]), int(epoch)


def _as_of(history: Iterable[Entry], c: int) -> list[Entry]:
    """The ledger entries a checkpoint at epoch ``c`` saves: those committed before ``c``, and of a
    streaming query only its newest (a retry of an older batch is below its watermark)."""
    entries: list[Entry] = []
    newest: dict[str, Entry] = {}
    for e in history:
        if e[3] >= c:
            continue
        if e[2]:
            entries.append(e)
        elif e[0] not in newest or e[1] > newest[e[0]][1]:
            newest[e[0]] = e
    return [*entries, *newest.values()]


# -- the participants ------------------------------------------------------------------------------
def _checkpoint_epochs(ck: Any, after: int, upto: int | None) -> Iterator[int]:
    """The checkpoint epochs ``after < c <= upto``, in order."""
    c = (after // ck.every + 1) * ck.every
    while upto is not None and c <= upto:
        yield c
        c += ck.every


class SourceDurability:
    """A bridge source's participant ``spark/<name>`` and commit log on one worker (see the module).

    Built before the source's operators run: it restores the committed batches into ``ledger``
    (worker 0) and ``staging`` (every worker), and the complete logged epochs from the resume epoch
    on, which worker 0's control operator publishes again (:data:`~spark_bridge.ledger.REPLAY`)."""

    def __init__(self, ck: Any, name: str, index: int, peers: int, ledger: Any, staging: Any) -> None:
        self.ck = ck
        self.index = index
        self.participant = ck.register(f"spark/{name}")
        self.log = CommitLog(ck.store.fs, ck.store.root, name, index, peers)
        self.offered = ck.resume_epoch
        replay = self.log.committed(ck.resume_epoch)
        self._replay = {logged.epoch: logged for logged in replay}
        entries = [*ledger_entries(self.participant.restore()), *(logged.entry for logged in replay)]
        staging.restore(entries)
        if index == 0:
            ledger.restore(entries, replay)
            ledger.retain_from(self.offered)  # what the next checkpoint needs, and each query's newest
        self._ledger = ledger
        self.log.truncate(ck.resume_epoch)

    def replayed(self, epoch: int) -> tuple[bytes | None, Frames]:
        """This worker's rows of the logged ``epoch`` being replayed."""
        logged = self._replay.pop(epoch, None)
        if logged is None:
            raise CheckpointError(f"spark_bridge: epoch {epoch} is replayed, but its log under {self.log.folder} "
                                  f"was not complete when this worker started")
        return self.log.frames(logged)

    def offer_through(self, frontier: int | None) -> None:
        """Every epoch before ``frontier`` (the source's least time; None: ended) is applied here:
        offer the checkpoint epochs up to it (worker 0: the ledger's changed queries), and delete
        the log files the latest committed checkpoint covers."""
        for c in _checkpoint_epochs(self.ck, self.offered, frontier):
            changed: dict[str, bytes | None] = {}
            if self.index == 0:
                entries = _as_of(self._ledger.history(), c)
                changed = ledger_blobs(entries, {e[0] for e in entries if e[3] >= self.offered})
            self.participant.offer(c, changed)
            self.offered = c
            if self.index == 0:
                self._ledger.retain_from(c)
            latest = self.ck.store.latest()
            if latest is not None:
                self.log.truncate(latest.epoch)

    def close(self) -> None:
        """The source ended: its ledger will not change again."""
        self.participant.close()
        if self.index == 0:
            self._ledger.retain_from(None)  # no checkpoint to come


class SinkDurability:
    """A bridge sink's participant ``spark-sink/<name>`` and durable release point on one worker
    (see the module). Restores the sink's saved epochs and release point into ``buffer`` and
    persists every later release before it is answered."""

    def __init__(self, ck: Any, name: str, index: int, peers: int, buffer: Any) -> None:
        self.ck = ck
        self.index = index
        self.fs = ck.store.fs
        self.folder = f"{ck.store.root.rstrip('/')}/spark-sink/{name}"
        self.participant = ck.register(f"spark-sink/{name}")
        self.offered = ck.resume_epoch
        self.buffer = buffer
        self.saved: dict[int, list[str]] = {}  # epoch -> its keys in the checkpoint
        buffer.released = self._released()
        mine = [k for k in self.participant.keys() if int(k[1:6]) % peers == index]
        for key, blob in sorted(self.participant.restore(mine).items()):
            epoch = int(key.rsplit("/e", 1)[1])
            self.saved.setdefault(epoch, []).append(key)
            if epoch >= buffer.released:
                buffer.complete.setdefault(epoch, []).extend(decode(blob, f"{key} in {ck.manifest.path}")[2])
                buffer.max_seen = max(buffer.max_seen, epoch)
        buffer.on_release = self.release

    def _released(self) -> int:
        try:
            names = self.fs.ls(self.folder, detail=False)
        except FileNotFoundError:
            return 0
        points = [0]
        for n in names:
            if n.rsplit("/", 1)[-1].startswith("released-w") and ".tmp-" not in n:
                try:
                    points.append(int(self.fs.cat_file(n)))
                except (OSError, ValueError) as e:
                    raise CheckpointError(f"spark_bridge release marker {n} is corrupt: {e}") from e
        return max(points)

    def release(self, upto: int) -> None:
        """A reader released every epoch before ``upto``: durable before the release is answered."""
        _write_atomic(self.fs, f"{self.folder}/released-w{self.index:05d}", [str(upto).encode()])

    def offer_through(self, frontier: int | None) -> None:
        """Every epoch before ``frontier`` is complete here: offer the checkpoint epochs up to it,
        each with the complete epochs before it that no reader released."""
        for c in _checkpoint_epochs(self.ck, self.offered, frontier):
            complete = self.buffer.complete
            changed: dict[str, bytes | None] = {}
            for t in [t for t in self.saved if t not in complete]:
                changed.update(dict.fromkeys(self.saved.pop(t)))
            for t in sorted(t for t in complete if t < c and t not in self.saved):
                key = f"w{self.index:05d}/e{t:012d}"
                changed[key] = b"".join(encode({"epoch": t}, None, complete[t]))
                self.saved[t] = [key]
            self.participant.offer(c, changed)
            self.offered = c

    def close(self) -> None:
        """The sink's input ended: nothing more is offered (releases stay durable)."""
        self.participant.close()
