"""The checkpoint store against a dictionary model: incremental key maps, garbage collection,
atomic manifests, and clear refusals of corrupt, missing, foreign and stale files."""
from __future__ import annotations

import errno
import json
import os
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from timely.checkpoint.store import CheckpointError, DamagedManifest, Store

KEYS = [f"bin/{i}" for i in range(6)]

# one checkpoint: per worker, changed keys -> new value (None deletes)
changes = st.lists(st.dictionaries(st.sampled_from(KEYS), st.one_of(st.none(), st.binary(max_size=20)), max_size=4),
                   min_size=2, max_size=2)


def commit_ready(store: Store, peers: int):
    """Commit what every worker reached (there must be something)."""
    found = store.committable(peers)
    assert found is not None
    return store.commit(found[0], peers, found[1])


def disjoint(per_worker: list[dict]) -> list[dict]:
    """Each key offered by one worker only (the store refuses a key offered twice)."""
    seen: set = set()
    out = []
    for d in per_worker:
        out.append({k: v for k, v in d.items() if k not in seen})
        seen |= set(d)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=st.lists(changes, min_size=1, max_size=6), keep=st.integers(1, 3))
def test_incremental_checkpoints_match_a_dictionary_model(tmp_path, history: list, keep: int) -> None:
    store = Store(str(tmp_path / uuid.uuid4().hex), "job", keep=keep)
    model: dict[str, bytes] = {}
    snapshots = []
    for i, per_worker in enumerate(history):
        epoch = 2 * (i + 1)
        per_worker = disjoint(per_worker)
        for w, changed in enumerate(per_worker):
            store.write_part(epoch, w, {"S": changed}, meta={"w": w})
        manifest = commit_ready(store, 2)
        for changed in per_worker:
            for k, v in changed.items():
                if v is None:
                    model.pop(k, None)
                else:
                    model[k] = v
        snapshots.append((epoch, dict(model)))
        assert store.read(manifest, "S") == model
        assert manifest.meta == {0: {"w": 0}, 1: {"w": 1}}
        assert store.read(manifest, "S", keys=["bin/0", "nope"]) == {k: v for k, v in model.items() if k == "bin/0"}
    # The kept manifests are still whole after garbage collection; older ones are gone.
    kept = sorted(os.listdir(tmp_path / store.root.rsplit("/", 1)[-1] / "manifests"))
    assert len(kept) == min(keep, len(history))
    for epoch, state in snapshots[-keep:]:
        assert store.read(store.load(f"{store.root}/manifests/{epoch:020d}.json"), "S") == state
    # Every part file left is needed by a kept manifest (nothing leaks).
    needed = set().union(*(store.load(f"{store.root}/manifests/{n}").files() for n in kept))
    assert set(os.listdir(f"{store.root}/parts")) <= needed | set()
    assert os.listdir(f"{store.root}/pending") == []


def test_a_checkpoint_in_progress_leaves_the_previous_one_whole(tmp_path) -> None:
    store = Store(str(tmp_path), "job")
    store.write_part(1, 0, {"S": {"a": b"1"}})
    first = commit_ready(store, 1)
    store.write_part(2, 0, {"S": {"a": b"2"}})  # crash before the commit
    assert store.latest().epoch == 1 and store.read(store.latest(), "S") == {"a": b"1"}
    # A run after the crash does not commit the crashed run's part with its own.
    again = Store(str(tmp_path), "job", run="second")
    assert again.committable(1) is None
    again.write_part(2, 0, {"S": {"a": b"two"}})
    assert again.read(commit_ready(again, 1), "S") == {"a": b"two"}
    assert first.epoch == 1


def test_a_failed_write_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    store = Store(str(tmp_path), "job")
    store.write_part(1, 0, {"S": {"a": b"1"}})
    commit_ready(store, 1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint file .*parts/e0+2-w00000.*No space left"):
        store.write_part(2, 0, {"S": {"a": b"2"}})
    monkeypatch.undo()
    assert store.read(store.latest(), "S") == {"a": b"1"}


def test_foreign_corrupt_and_missing_files_are_refused(tmp_path) -> None:
    store = Store(str(tmp_path), "job-a")
    store.write_part(1, 0, {"S": {"a": b"payload"}})
    manifest = commit_ready(store, 1)
    with pytest.raises(CheckpointError, match="belongs to another job"):
        Store(str(tmp_path), "job-b").latest()
    part = tmp_path / "parts" / manifest.states["S"]["a"][0]
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{part.name} is corrupt: state 'S' key 'a'"):
        store.read(manifest, "S")
    part.unlink()
    with pytest.raises(CheckpointError, match=rf"{part.name} .*cannot be read"):
        store.read(manifest, "S")
    path = tmp_path / "manifests" / f"{1:020d}.json"
    head, _, data = path.read_bytes().partition(b"\n")
    body = json.loads(data)
    body["epoch"] = 7
    path.write_bytes(head + b"\n" + json.dumps(body).encode())
    fresh = Store(str(tmp_path), "job-a")  # (a store does not read again a manifest it has read)
    with pytest.raises(CheckpointError, match="corrupt .checksum mismatch"):
        fresh.latest()
    path.write_text(json.dumps(body))  # a manifest of format 1 (plain JSON), or garbage
    with pytest.raises(CheckpointError, match="is not a manifest of format 2"):
        Store(str(tmp_path), "job-a").latest()


def test_a_key_offered_twice_is_an_error(tmp_path) -> None:
    store = Store(str(tmp_path), "job")
    store.write_part(1, 0, {"S": {"a": b"x"}})
    store.write_part(1, 1, {"S": {"a": b"y"}})
    with pytest.raises(CheckpointError, match="key 'a' offered by workers 0 and 1"):
        commit_ready(store, 2)


def test_any_fsspec_url() -> None:
    store = Store(f"memory://ckpt-{uuid.uuid4().hex}", "job")
    store.write_part(3, 0, {"S": {"k": b"v"}, "T": {}})
    manifest = commit_ready(store, 1)
    assert store.latest().epoch == 3 and store.read(manifest, "S") == {"k": b"v"}


# per epoch, per worker: None (nothing changed: only the reached marker moves) or the changed keys
sparse = st.lists(st.lists(st.one_of(st.none(), st.dictionaries(st.sampled_from(KEYS), st.binary(max_size=8),
                                                                  min_size=1, max_size=3)),
                           min_size=2, max_size=2), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=sparse, commit_after=st.lists(st.booleans(), min_size=8, max_size=8),
       lag=st.integers(0, 3))
def test_epochs_without_changes_write_no_part_and_commits_cover_them(tmp_path, history, commit_after, lag) -> None:
    """Workers hand over every epoch: a part where something changed, else a reached marker. The
    committer commits the newest epoch all workers reached, whatever lags; each manifest equals the
    model's state at its epoch."""
    store = Store(str(tmp_path / uuid.uuid4().hex), "job")
    reached = [0, 0]
    for i, per_worker in enumerate(history):
        epoch = i + 1
        for w, changed in enumerate(disjoint([c or {} for c in per_worker])):
            if w == 1 and i >= len(history) - lag:
                continue  # worker 1 lags behind: it has not handed these epochs over yet
            if per_worker[w] is None or not changed:
                store.write_reached(w, epoch)
            else:
                store.write_part(epoch, w, {"S": changed})
            reached[w] = epoch
        if commit_after[i] or i == len(history) - 1:
            found = store.committable(2)
            if min(reached) <= (store.latest().epoch if store.latest() else 0):
                assert found is None
                continue
            assert found is not None and found[0] == min(reached)
            manifest = store.commit(found[0], 2, found[1])
            expect: dict[str, bytes] = {}
            for e in range(1, found[0] + 1):  # the changes of every epoch up to the commit, in order
                for w, changed in enumerate(disjoint([c or {} for c in history[e - 1]])):
                    expect.update(changed)
            assert store.read(manifest, "S") == expect
    parts = os.listdir(f"{store.root}/parts")
    assert len(parts) <= sum(c is not None for per_worker in history for c in per_worker)


def test_a_far_jump_of_the_frontier_writes_one_marker_not_a_part_per_epoch(tmp_path) -> None:
    from timely.checkpoint.checkpointer import Checkpointer
    ck = Checkpointer(Store(str(tmp_path), "timely"), every=1, index=0, peers=1)
    p = ck.register("s")
    p.offer(1, {"k": b"v"}, meta={"m": 1})
    for e in range(2, 20_001):  # the frontier jumped 20,000 epochs with nothing changed
        p.offer(e, {}, meta={"m": 1})
    ck.flush()
    assert ck.stats()["parts"] == 1
    m = Store(str(tmp_path), "timely").latest()
    assert m.epoch == 20_000 and Store(str(tmp_path), "timely").read(m, "s") == {"k": b"v"}
    assert len(os.listdir(tmp_path / "parts")) == 1
    ck.close()


def test_a_worker_that_finished_holds_no_commit_back(tmp_path) -> None:
    store = Store(str(tmp_path), "job")
    store.write_part(1, 0, {"S": {"a": b"1"}})
    store.write_reached(0, 1, final=True)  # worker 0's inputs ended at epoch 1
    store.write_part(3, 1, {"S": {"b": b"2"}})
    epoch, parts = store.committable(2)
    assert epoch == 3 and store.read(store.commit(epoch, 2, parts), "S") == {"a": b"1", "b": b"2"}


def test_garbage_collection_spares_markers_being_written_and_drops_other_runs(tmp_path) -> None:
    old = Store(str(tmp_path), "job", run="old")
    old.write_reached(0, 1)
    store = Store(str(tmp_path), "job", run="new")
    store.write_part(1, 0, {"S": {"a": b"1"}})
    pending = tmp_path / "pending"
    [mine] = [p for p in os.listdir(pending) if p.startswith("e")]
    in_flight = pending / (mine.replace("e00000000000000000001-w00000", "r-w00000") + ".tmp-0123abcd")
    in_flight.write_bytes(b"{}")  # this run's reached marker, half written (renamed when done)
    commit_ready(store, 1)
    assert os.listdir(pending) == [in_flight.name]  # the old run's marker is gone, the write in flight stays


def test_a_part_written_while_the_committer_lists_is_not_missed(tmp_path) -> None:
    """Worker 1 writes its part of epoch 40 and moves its reached marker to 50 while worker 0's
    committer is between listing ``pending/`` and reading the reached markers. The commit must
    hold that part, or restores lose it (and the clean-up deletes it): the reached markers are read
    first, the part markers listed after."""
    store = Store(str(tmp_path), "job")
    store.write_part(10, 0, {"s": {"a": b"A10"}})
    store.write_part(10, 1, {"s": {"b": b"B10"}})
    store.write_reached(0, 50)
    store.write_reached(1, 30)
    real_ls, raced = store.fs.ls, []

    def ls(path, *args, **kwargs):
        names = real_ls(path, *args, **kwargs)
        if path.endswith("pending") and not raced:
            raced.append(1)  # worker 1 goes on, between this listing and what the committer reads next
            store.write_part(40, 1, {"s": {"b": b"B40"}})
            store.write_reached(1, 50)
        return names

    store.fs.ls = ls
    epoch, parts = store.committable(2)
    store.fs.ls = real_ls
    assert epoch == 50 and raced
    assert sorted((p["epoch"], p["worker"]) for p in parts) == [(10, 0), (10, 1), (40, 1)]
    manifest = store.commit(epoch, 2, parts)
    assert store.read(manifest, "s") == {"a": b"A10", "b": b"B40"}


def test_a_commit_that_ends_before_it_is_marked_busy_leaves_commits_going(tmp_path) -> None:
    """The writer thread may run a queued commit to its end before ``poll`` returns from queuing
    it: the busy flag must not stay set then, or worker 0 never commits again."""
    from timely.checkpoint import checkpointer
    ck = checkpointer.Checkpointer(Store(str(tmp_path), "timely"), every=1, index=0, peers=1)
    try:
        ck._queue.put_nowait = lambda job: job()  # as if the writer ran it at once
        ck._handed, ck._committed, ck._next_poll = 1, 0, 0.0
        ck.poll()
        assert not ck._commit_busy
    finally:
        del ck._queue.put_nowait
        ck.close()


def _cut_short(path) -> None:
    """``path`` as a write that a crash cut short leaves it on a store without atomic writes."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_damaged_newest_manifest_is_passed_over_and_the_next_run_commits_past_it(tmp_path, capfd) -> None:
    first = Store(str(tmp_path), "job", keep=3)
    for epoch, value in ((2, b"2"), (4, b"4"), (6, b"6")):
        first.write_part(epoch, 0, {"S": {"a": value, f"k{epoch}": value}})
        commit_ready(first, 1)
    _cut_short(tmp_path / "manifests" / f"{6:020d}.json")
    again = Store(str(tmp_path), "job", keep=3, run="second")
    assert again.latest().epoch == 4 and again.latest().epoch == 4
    err = capfd.readouterr().err
    assert err.count(f"{6:020d}.json is cut short") == 1 and "passed over for an older checkpoint" in err
    # The next run resumes at 4 and commits its own epoch 5, below the damaged one: the parts
    # since the intact manifest are applied (not skipped as covered by the damaged one), and the
    # damaged file is removed as garbage by the store that writes manifests.
    assert again.committable(1) is None
    again.write_part(5, 0, {"S": {"a": b"five"}})
    manifest = commit_ready(again, 1)
    assert manifest.epoch == 5
    assert again.read(manifest, "S") == {"a": b"five", "k2": b"2", "k4": b"4"}
    assert sorted(os.listdir(tmp_path / "manifests")) == [f"{e:020d}.json" for e in (2, 4, 5)]
    assert Store(str(tmp_path), "job").latest().epoch == 5
    assert "passed over" not in capfd.readouterr().err


def test_a_run_rewrites_the_epoch_of_a_damaged_manifest_and_none_intact_is_an_error(tmp_path) -> None:
    first = Store(str(tmp_path), "job")
    for epoch in (1, 2):
        first.write_part(epoch, 0, {"S": {"a": str(epoch).encode()}})
        commit_ready(first, 1)
    _cut_short(tmp_path / "manifests" / f"{2:020d}.json")
    again = Store(str(tmp_path), "job", run="second")
    again.write_part(2, 0, {"S": {"a": b"two"}})
    assert again.read(commit_ready(again, 1), "S") == {"a": b"two"}  # written over the damaged file
    _cut_short(tmp_path / "manifests" / f"{1:020d}.json")
    _cut_short(tmp_path / "manifests" / f"{2:020d}.json")
    with pytest.raises(DamagedManifest, match=rf"{2:020d}.json is cut short"):  # the newest one's error
        Store(str(tmp_path), "job").latest()


def test_a_whole_manifest_whose_bytes_changed_is_refused_not_passed_over(tmp_path) -> None:
    # It was complete, so a sink or the Spark ledger may have acted on it: falling back to an
    # older checkpoint could lose what they released. Only a write cut short is passed over.
    store = Store(str(tmp_path), "job")
    for epoch in (1, 2):
        store.write_part(epoch, 0, {"S": {"a": str(epoch).encode()}})
        commit_ready(store, 1)
    path = tmp_path / "manifests" / f"{2:020d}.json"
    path.write_bytes(path.read_bytes().replace(b'"epoch":2', b'"epoch":3'))
    with pytest.raises(CheckpointError, match="corrupt .checksum mismatch") as info:
        Store(str(tmp_path), "job").latest()
    assert not isinstance(info.value, DamagedManifest)


def test_a_manifest_removed_between_listing_and_reading_makes_latest_list_again(tmp_path) -> None:
    writer = Store(str(tmp_path), "job", keep=3)
    for epoch in (2, 4):
        writer.write_part(epoch, 0, {"S": {"a": str(epoch).encode()}})
        commit_ready(writer, 1)
    newest = tmp_path / "manifests" / f"{4:020d}.json"
    _cut_short(newest)
    reader = Store(str(tmp_path), "job", run="reader")
    real = reader.fs.cat_file

    def cat(path, *args, **kwargs):  # the writer's garbage collection removes it just after the listing
        if path.endswith(newest.name) and newest.exists():
            newest.unlink()
        return real(path, *args, **kwargs)

    reader.fs.cat_file = cat
    assert reader.latest().epoch == 2
