"""Where checkpoints live: part files, manifests, incremental key maps, garbage collection.

Layout under the checkpoint URL (a local directory or any fsspec URL)::

    manifests/<epoch:020d>.json     a complete checkpoint: written last, atomically
    parts/e<epoch:020d>-w<worker:05d>-<id>.part
                                    one worker's changed blobs at that epoch (and a JSON index)
    pending/e<epoch:020d>-w<worker:05d>-<run>.json
                                    "this worker's part is durable": read by the committer
    pending/r-w<worker:05d>-<run>.json
                                    "this worker reached epoch r": its state is unchanged since its
                                    newest part (written instead of empty parts, overwritten)

A **part** file is ``MAGIC``, an 8-byte little-endian index length, the JSON index
``{state: {key: [offset, length, crc32] | null}}`` (``null``: the key was deleted) and the blobs.
A **manifest** maps every live ``(state, key)`` to ``[file, offset, length, crc32]``: the key map of
the previous manifest with the parts of its epoch applied, so a checkpoint writes only what changed
since the last one and still names everything (incremental). It also records the job, the epoch,
the worker count and each worker's meta. Its file is ``MANIFEST_MAGIC``, the SHA-256 (hex) of the
JSON body, a newline and the body, in which the part files are named once (``files``) and a key's
reference holds its file's index.

A worker writes a part only at an epoch where something changed; across epochs without changes it
only moves its *reached* marker. A worker has *reached* ``r`` once it has handed over every epoch up
to ``r`` (its newest part's epoch or its reached marker, whichever is higher); its state at any
checkpoint epoch ``e <= r`` is its parts up to ``e`` applied in order. So the committer commits
``e = min`` over the workers of what they reached, with every part up to ``e`` (several per worker
when commits lag, none from a worker that changed nothing): a far jump of the frontier costs one
marker, not one part per epoch passed.

Invariants: a manifest is written only after every part it names is durable, and it is the last
thing a checkpoint writes; so a crash at any moment leaves the previous manifest complete. Garbage
collection keeps the newest ``keep`` manifests and every file they name, and never touches parts of
epochs above the newest manifest (a checkpoint in progress).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import TimelyError

FORMAT = 2
#: A manifest file starts with this, the SHA-256 (hex) of the JSON body that follows, and a newline.
MANIFEST_MAGIC = b"TIMELYMANIFEST "
MAGIC = b"TIMELYCKPT\x00\x01"
_LEN = struct.Struct("<Q")

#: A blob to write: its bytes, or a callable that makes them (called on the writing thread).
Blob = bytes | bytearray | memoryview | Callable[[], bytes]


class CheckpointError(TimelyError, RuntimeError):
    """A checkpoint cannot be written or used: corrupt or missing file, another job's checkpoint,
    storage failure. The message names the file."""


class DamagedManifest(CheckpointError):
    """A manifest file cut short: the beginning of a manifest, whose write never completed (on a
    store without atomic writes, a crash during it). No one can have used it, as its write never
    returned: :meth:`Store.latest` passes it over. A whole manifest whose bytes changed since
    (checksum mismatch, its body still well formed) is a plain :class:`CheckpointError`: it was
    complete, and others may have acted on it."""


class _Vanished(CheckpointError):
    """A manifest listed a moment ago is gone (the writer's garbage collection removed it)."""


class Manifest:
    """One complete checkpoint: ``epoch`` (state reflects the inputs before it), ``peers`` (the
    workers that wrote it), ``job``, ``meta`` (per worker index, what it gave) and the key map."""

    def __init__(self, body: dict, path: str) -> None:
        self.path = path
        self.epoch: int = body["epoch"]
        self.peers: int = body["peers"]
        self.job: str = body["job"]
        self.meta: dict[int, Any] = {int(w): m for w, m in body["meta"].items()}
        self.states: dict[str, dict[str, list]] = body["states"]
        self.created: float = body.get("created", 0.0)

    def keys(self, state: str) -> list[str]:
        """The keys ``state`` holds in this checkpoint."""
        return list(self.states.get(state, {}))

    def files(self) -> set[str]:
        """Every part file this checkpoint needs."""
        return {ref[0] for refs in self.states.values() for ref in refs.values()}

    def __repr__(self) -> str:
        return f"Manifest(epoch={self.epoch}, peers={self.peers}, states={sorted(self.states)})"


def _encode(body: dict) -> bytes:
    """A manifest's file: the magic, the SHA-256 of the body's JSON, a newline, the JSON. Part
    files are named once, in ``files``; a key's reference holds its file's index there."""
    files: dict[str, int] = {}
    states = {state: {key: [files.setdefault(ref[0], len(files)), *ref[1:]] for key, ref in refs.items()}
              for state, refs in body["states"].items()}
    data = json.dumps({**body, "files": list(files), "states": states}, separators=(",", ":")).encode()
    return b"".join([MANIFEST_MAGIC, hashlib.sha256(data).hexdigest().encode(), b"\n", data])


def _decode(raw: bytes, path: str) -> dict:
    """The body of a manifest file (references resolved to file names), checked against its digest."""
    head, sep, data = raw.partition(b"\n")
    if not sep and MANIFEST_MAGIC.startswith(raw[:len(MANIFEST_MAGIC)]):
        raise DamagedManifest(f"checkpoint manifest {path} is cut short ({len(raw)} bytes, no complete header)")
    if not head.startswith(MANIFEST_MAGIC) or not sep:
        raise CheckpointError(f"checkpoint manifest {path} is not a manifest of format {FORMAT} "
                              f"(an older version's checkpoint, or corrupt)")
    if hashlib.sha256(data).hexdigest().encode() != head[len(MANIFEST_MAGIC):]:
        try:
            json.loads(data)
        except ValueError:  # the beginning of a body: a write cut short
            raise DamagedManifest(f"checkpoint manifest {path} is cut short (checksum mismatch, "
                                  f"its body ends after {len(data)} bytes)") from None
        raise CheckpointError(f"checkpoint manifest {path} is corrupt (checksum mismatch)")
    try:
        body = json.loads(data)
        files = body.pop("files")
        body["states"] = {state: {key: [files[ref[0]], *ref[1:]] for key, ref in refs.items()}
                          for state, refs in body["states"].items()}
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointError(f"checkpoint manifest {path} is unreadable or corrupt: {e}") from e
    return body


class Store:
    """The checkpoints of job ``job`` at ``url`` (created if missing). ``keep`` manifests are kept.

    ``run`` names one execution of the job (the same on all its workers, another after a restart):
    a part is committed only with the parts of its own run, never with those a crashed run left.
    """

    def __init__(self, url: str, job: str, keep: int = 2, run: str = "") -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.url = url
        self.job = job
        self.keep = keep
        self._run = hashlib.sha256(run.encode()).hexdigest()[:12]
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
            self.root = root.rstrip("/")
            for sub in ("manifests", "parts", "pending"):
                self.fs.makedirs(self._path(sub), exist_ok=True)
        except (OSError, ValueError, ImportError) as e:  # (ImportError: fsspec lacks the scheme's package)
            raise CheckpointError(f"checkpoint storage {url!r} cannot be used: {e}") from e
        self._local = isinstance(self.fs, LocalFileSystem)
        self._known: dict[str, Manifest] = {}  # manifests read or written, by path (the kept ones)
        self._warned: set[str] = set()  # damaged manifests already named on stderr

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    @property
    def process_local(self) -> bool:
        """True if the storage lives in this process's memory (fsspec ``memory://``): another
        process, a forked worker included, sees none of what this one writes."""
        protocol = self.fs.protocol
        return "memory" in ((protocol,) if isinstance(protocol, str) else protocol)

    # -- writing -------------------------------------------------------------------------------
    def _write_atomic(self, path: str, data: bytes) -> None:
        """``data`` at ``path``, all or nothing, durable when this returns."""
        try:
            if self._local:
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path)
                except OSError:
                    with contextlib.suppress(OSError):  # (a full disk: nothing else removes it)
                        os.unlink(tmp)
                    raise
                fd = os.open(os.path.dirname(path), os.O_RDONLY)
                try:
                    os.fsync(fd)  # the rename itself is durable
                finally:
                    os.close(fd)
            else:
                self.fs.pipe_file(path, data)  # one PUT: object stores never show half an object
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoint file {path}: {e}") from e

    def write_part(self, epoch: int, worker: int, states: Mapping[str, Mapping[str, Blob | None]],
                   meta: Any = None) -> dict:
        """Write ``worker``'s changed blobs at ``epoch`` (``None`` deletes a key; a callable is
        called here for its bytes) as one durable part file, then its pending marker; return the
        part record (JSON-able)."""
        index: dict[str, dict[str, list | None]] = {}
        blobs: list[bytes] = []
        offset = 0
        for state, changed in states.items():
            entries: dict[str, list | None] = {}
            for key, blob in changed.items():
                if blob is None:
                    entries[key] = None
                    continue
                blob = bytes(blob() if callable(blob) else blob)
                entries[key] = [offset, len(blob), zlib.crc32(blob)]
                blobs.append(blob)
                offset += len(blob)
            index[state] = entries
        head = json.dumps(index, separators=(",", ":")).encode()
        name = f"e{epoch:020d}-w{worker:05d}-{uuid.uuid4().hex[:12]}.part"
        base = len(MAGIC) + _LEN.size + len(head)
        self._write_atomic(self._path("parts", name), b"".join([MAGIC, _LEN.pack(len(head)), head, *blobs]))
        record = {"epoch": epoch, "worker": worker, "file": name, "base": base, "states": index, "meta": meta}
        self._write_atomic(self._pending(epoch, worker), json.dumps(record).encode())
        return record

    def _pending(self, epoch: int, worker: int) -> str:
        return self._path("pending", f"e{epoch:020d}-w{worker:05d}-{self._run}.json")

    def write_reached(self, worker: int, epoch: int, final: bool = False) -> None:
        """Record that ``worker`` reached ``epoch`` with no change since its newest part (written
        after that part is durable). ``final``: its state changes no more (its inputs ended), so it
        holds no later commit back."""
        self._write_atomic(self._path("pending", f"r-w{worker:05d}-{self._run}.json"),
                           json.dumps({"reached": epoch, "final": final}).encode())

    def _pending_names(self) -> list[str]:
        """The file names in ``pending/``, listed afresh (not from a listings cache)."""
        path = self._path("pending")
        self.fs.invalidate_cache(path)
        return [n.rsplit("/", 1)[-1] for n in self.fs.ls(path, detail=False)]

    def ended(self, peers: int) -> bool:
        """True once every one of the ``peers`` workers of this run has written a final reached
        marker (its state changes no more: its inputs ended, or the job did)."""
        suffix = f"-{self._run}.json"
        try:
            final = set()
            for n in self._pending_names():
                if n.startswith("r-w") and n.endswith(suffix):
                    if json.loads(self.fs.cat_file(self._path("pending", n)))["final"]:
                        final.add(int(n[3:8]))
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read the reached markers in {self._path('pending')}: {e}") from e
        return final >= set(range(peers))

    def committable(self, peers: int) -> tuple[int, list[dict]] | None:
        """The newest epoch that every worker of this run has reached, above the newest manifest,
        with the part records (several per worker, or none) up to it; ``None`` when there is none."""
        try:
            reached: dict[int, tuple[int, bool]] = {}
            markers: list[tuple[int, int, str]] = []
            suffix = f"-{self._run}.json"
            # The reached markers first, then a second listing for the part markers. Invariant
            # relied on: a worker writes a part's marker before it moves its reached marker past
            # that part's epoch, so every part up to the reached epoch read is in the later listing
            # (one listing for both could show a reached marker that moved past a part written
            # after the listing: the commit would miss that part, and the clean-up delete it).
            for n in self._pending_names():
                if n.endswith(suffix) and n.startswith("r-w"):
                    r = json.loads(self.fs.cat_file(self._path("pending", n)))
                    reached[int(n[3:8])] = (int(r["reached"]), bool(r["final"]))
            for n in self._pending_names():
                if n.endswith(suffix) and n.startswith("e") and n[1:21].isdigit():
                    markers.append((int(n[1:21]), int(n[23:28]), n))
            for epoch, w, _ in markers:
                r, final = reached.get(w, (0, False))
                reached[w] = (max(r, epoch), final)
            if len(reached) < peers or any(w >= peers for w in reached):
                return None
            open_ = [r for r, final in reached.values() if not final]
            epoch = min(open_) if open_ else max(r for r, _ in reached.values())
            newest = self.latest()
            done = newest.epoch if newest is not None else -1
            if epoch <= max(done, 0):
                return None
            # (markers of epochs the newest manifest covers are left over from a clean-up that
            # failed part way: applying them again could bring back an older value)
            parts = [json.loads(self.fs.cat_file(self._path("pending", n)))
                     for e, _, n in sorted(markers) if done < e <= epoch]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read the pending parts in {self._path('pending')}: {e}") from e
        return epoch, parts

    def commit(self, epoch: int, peers: int, parts: Iterable[dict]) -> Manifest:
        """Write the manifest of ``epoch`` from the previous one and ``parts`` (the part records of
        epochs up to ``epoch`` since the previous one, see :meth:`committable`), applied in epoch
        order, atomically; then collect garbage. A worker's meta is that of its newest part (or the
        previous manifest's). A key offered by two workers at one epoch is an error."""
        previous = self.latest()
        if previous is not None and previous.epoch >= epoch:
            raise CheckpointError(f"checkpoint of epoch {epoch} would not be newer than {previous.path}")
        states: dict[str, dict[str, list]] = {s: dict(refs) for s, refs in (previous.states if previous else {}).items()}
        meta: dict[str, Any] = {}
        if previous is not None and previous.peers == peers:
            meta = {str(w): m for w, m in previous.meta.items()}
        owner: dict[tuple[int, str, str], int] = {}
        for part in sorted(parts, key=lambda p: (p["epoch"], p["worker"])):
            if part["epoch"] > epoch:
                raise CheckpointError(f"part {part['file']} is of epoch {part['epoch']}, after {epoch}")
            meta[str(part["worker"])] = part["meta"]
            for state, entries in part["states"].items():
                refs = states.setdefault(state, {})
                for key, ref in entries.items():
                    other = owner.setdefault((part["epoch"], state, key), part["worker"])
                    if other != part["worker"]:
                        raise CheckpointError(f"state '{state}' key {key!r} offered by workers {other} and "
                                              f"{part['worker']} at epoch {part['epoch']}")
                    if ref is None:
                        refs.pop(key, None)
                    else:
                        refs[key] = [part["file"], part["base"] + ref[0], ref[1], ref[2]]
        body = {"format": FORMAT, "job": self.job, "epoch": epoch, "peers": peers, "created": time.time(),
                "meta": meta, "states": states}
        path = self._path("manifests", f"{epoch:020d}.json")
        self._write_atomic(path, _encode(body))
        manifest = Manifest(body, path)
        self._known[path] = manifest
        self._collect(manifest)
        return manifest

    # -- reading -------------------------------------------------------------------------------
    def _manifest_paths(self) -> list[tuple[int, str]]:
        try:
            names = self.fs.ls(self._path("manifests"), detail=False)
        except FileNotFoundError:
            return []
        found = []
        for n in names:
            base = n.rsplit("/", 1)[-1]
            if base.endswith(".json") and base[:-5].isdigit():
                found.append((int(base[:-5]), n))
        return sorted(found)

    def load(self, path: str) -> Manifest:
        """The manifest at ``path``, checked (intact, of this job). Manifests this store wrote or
        read before are not read again (a manifest file never changes once written)."""
        known = self._known.get(path)
        if known is not None:
            return known
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError as e:
            raise _Vanished(f"checkpoint manifest {path} is gone: {e}") from e
        except OSError as e:
            raise CheckpointError(f"checkpoint manifest {path} is unreadable: {e}") from e
        body = _decode(raw, path)
        if body.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint manifest {path} has format {body.get('format')}, expected {FORMAT}")
        if body["job"] != self.job:
            raise CheckpointError(f"checkpoint {path} belongs to another job (job {body['job']!r:.80}, this job "
                                  f"{self.job!r:.80}): use another checkpoint directory, or remove it")
        manifest = self._known[path] = Manifest(body, path)
        return manifest

    def latest(self) -> Manifest | None:
        """The newest complete checkpoint, or ``None`` when there is none.

        A newer manifest file cut short (:class:`DamagedManifest`: on a store without atomic
        writes, a crash during its write) is passed over, with one line on stderr naming it, for
        the newest intact one: a job resuming from it reads its inputs again from that epoch on.
        When none is intact, the newest one's error is raised (starting from nothing would read
        every input again). A manifest removed by the writer's garbage collection between the
        listing and the reading (a newer one was committed meanwhile) makes it list again."""
        for _ in range(8):
            damaged: DamagedManifest | None = None
            try:
                for _, path in reversed(self._manifest_paths()):
                    try:
                        return self.load(path)
                    except DamagedManifest as e:
                        damaged = damaged or e
                        if path not in self._warned:
                            self._warned.add(path)
                            print(f"timely.checkpoint: {e}: passed over for an older checkpoint", file=sys.stderr)
            except _Vanished:
                self.fs.invalidate_cache(self._path("manifests"))
                continue
            if damaged is not None:
                raise damaged
            return None
        raise CheckpointError(f"the checkpoint manifests in {self._path('manifests')} keep changing while read")

    def read(self, manifest: Manifest, state: str, keys: Iterable[str] | None = None) -> dict[str, bytes]:
        """The blobs of ``state`` in ``manifest`` (only ``keys`` when given; absent keys are
        skipped), each checked against its checksum."""
        refs = manifest.states.get(state, {})
        wanted = refs if keys is None else {k: refs[k] for k in keys if k in refs}
        by_file: dict[str, list[tuple[str, list]]] = {}
        for key, ref in wanted.items():
            by_file.setdefault(ref[0], []).append((key, ref))
        out: dict[str, bytes] = {}
        for name, entries in by_file.items():
            path = self._path("parts", name)
            try:
                with self.fs.open(path, "rb") as f:
                    for key, (_, offset, length, crc) in sorted(entries, key=lambda e: e[1][1]):
                        f.seek(offset)
                        blob = f.read(length)
                        if len(blob) != length or zlib.crc32(blob) != crc:
                            raise CheckpointError(f"checkpoint file {path} is corrupt: state '{state}' key {key!r} "
                                                  f"fails its checksum")
                        out[key] = blob
            except OSError as e:
                raise CheckpointError(f"checkpoint file {path} (state '{state}', checkpoint {manifest.path}) "
                                      f"cannot be read: {e}") from e
        return out

    # -- garbage collection --------------------------------------------------------------------
    def _collect(self, newest: Manifest) -> None:
        """Delete manifests beyond the newest ``keep`` and damaged ones, the parts no kept manifest
        needs (of epochs up to ``newest``'s), the pending markers of those epochs, other runs'
        reached markers and the temporary files of writes that can no longer be in progress (see
        :meth:`_stale_tmp`)."""
        kept: list[Manifest] = []
        dropped: list[str] = []  # beyond the newest `keep`, or cut short (this store is the only writer)
        for _, p in reversed(self._manifest_paths()):
            try:
                manifest = newest if p == newest.path else self.load(p)
            except DamagedManifest:
                dropped.append(p)
                continue
            except _Vanished:
                continue
            if len(kept) < self.keep:
                kept.append(manifest)
            else:
                dropped.append(p)
        self._known = {m.path: m for m in kept}
        needed = set().union(*(m.files() for m in kept))
        try:
            for p in dropped:
                self.fs.rm_file(p)
            for sub in ("manifests", "parts", "pending"):
                for n in self.fs.ls(self._path(sub), detail=False):
                    base = n.rsplit("/", 1)[-1]
                    if ".tmp-" in base:
                        if self._stale_tmp(sub, base, n, newest):
                            self.fs.rm_file(n)
                        continue
                    if base.startswith("r-w") and base.endswith(".json") and not base.endswith(f"-{self._run}.json"):
                        self.fs.rm_file(n)  # another run's reached marker
                    if sub == "manifests" or not base.startswith("e") or not base[1:21].isdigit():
                        continue
                    if int(base[1:21]) <= newest.epoch and base not in needed:
                        self.fs.rm_file(n)
        except OSError:
            pass  # garbage left behind is collected next time; the checkpoint itself is complete

    def _stale_tmp(self, sub: str, base: str, path: str, newest: Manifest) -> bool:
        """True if ``base``, a temporary file of :meth:`_write_atomic` in ``sub`` (its writer was
        killed before the rename, or a write is in progress), is no write in progress, so
        :meth:`_collect` may remove it:

        * a manifest's: the committer (this store, the only one) writes one manifest at a time
          and is not writing one now, so one of an epoch up to ``newest``'s, or older than
          ``newest`` (modified before it was created), is a dead write's;
        * a part's or part marker's of an epoch up to ``newest``'s: every worker of this run had
          written its parts up to that epoch before the commit, and earlier runs have ended;
        * another run's reached marker's (earlier runs have ended). This run's reached markers
          move while it runs: their temporary files are left (a dead write's goes once another
          run commits)."""
        name = base.split(".tmp-", 1)[0]
        if sub == "manifests":
            if name.endswith(".json") and name[:-5].isdigit() and int(name[:-5]) <= newest.epoch:
                return True
            try:
                return float(self.fs.info(path)["mtime"]) < newest.created
            except (OSError, KeyError, TypeError, ValueError):
                return False
        if name.startswith("e") and name[1:21].isdigit():
            return int(name[1:21]) <= newest.epoch
        return name.startswith("r-w") and name.endswith(".json") and not name.endswith(f"-{self._run}.json")
