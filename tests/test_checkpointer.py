"""The checkpoint runtime of a worker (timely.checkpoint.checkpointer), in one process: offers, the
background writer, worker 0's commit, restore, refusals, and errors of the storage."""
from __future__ import annotations

import os
import time

import pytest

import timely
from timely import checkpoint
from timely.checkpoint import Checkpointer, CheckpointError, Store
from timely.checkpoint.checkpointer import JOB


def workers(url: str, peers: int, every: int = 2) -> list[Checkpointer]:
    return [Checkpointer(Store(url, JOB), every, i, peers) for i in range(peers)]


def settle(cks: list[Checkpointer], until, timeout: float = 5.0) -> None:
    """Poll like the step loop does until ``until()`` holds."""
    deadline = time.monotonic() + timeout
    while not until():
        for ck in cks:
            ck.poll()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_checkpoint_is_committed_once_every_worker_part_is_durable(tmp_path):
    url = str(tmp_path)
    cks = workers(url, 2)
    parts = [ck.register("counts") for ck in cks]
    for ck in cks:
        ck.built("df", 0xABC)
    parts[0].offer(2, {"a": b"1"}, meta={"w": 0})
    settle(cks[:1], lambda: cks[0].stats()["parts"] == 1)
    time.sleep(0.15)
    cks[0].poll()
    assert Store(url, JOB).latest() is None  # worker 1's part is missing: no manifest
    parts[1].offer(2, {})  # an empty part: nothing changed on worker 1
    settle(cks, lambda: cks[0].stats()["commits"] == 1)
    m = Store(url, JOB).latest()
    assert m.epoch == 2 and m.peers == 2 and m.keys("counts") == ["a"]
    # Incremental: epoch 4 changes "b" and deletes nothing; "a" is still named.
    parts[0].offer(4, {}, meta={"w": 4})
    parts[1].offer(4, {"b": b"2"})
    settle(cks, lambda: cks[0].stats()["commits"] == 2)
    for ck in cks:
        ck.flush()
        ck.close()
    again = workers(url, 3)  # rescaled: every worker sees the whole checkpoint
    assert [ck.resume_epoch for ck in again] == [4, 4, 4]
    p = again[2].register("counts")
    assert p.restore() == {"a": b"1", "b": b"2"} and p.restore(["b"]) == {"b": b"2"}
    assert p.meta() == {0: {"w": 4}, 1: None}  # what each worker offered last
    for ck in again:
        ck.close()


def test_offers_do_not_wait_for_the_write(tmp_path, monkeypatch):
    monkeypatch.setenv("TIMELY_CHECKPOINT_TEST_DELAY", "0.2")
    (ck,) = workers(str(tmp_path), 1)
    p = ck.register("s")
    p.offer(2, {"k": b"x" * 1000})
    assert ck.stats()["parts"] == 0  # returned before the write (0.2 s here), which runs on the background thread
    ck.flush()
    stats = ck.stats()
    assert stats["parts"] == 1 and stats["bytes"] == 1000 and stats["write_max_s"] >= 0.2
    assert stats["offer_block_max_s"] < stats["write_max_s"] and stats["commits"] == 1
    ck.close()


def test_offers_are_checked(tmp_path):
    (ck,) = workers(str(tmp_path), 1, every=3)
    p = ck.register("s")
    with pytest.raises(ValueError, match="not a checkpoint epoch"):
        p.offer(4, {})
    with pytest.raises(CheckpointError, match="without epoch 3"):
        p.offer(6, {})
    with pytest.raises(CheckpointError, match="registered twice"):
        ck.register("s")
    ck.close()


def test_a_closed_participant_no_longer_holds_checkpoints_back(tmp_path):
    (ck,) = workers(str(tmp_path), 1)
    src, state = ck.register("source"), ck.register("state")
    src.offer(2, {})
    src.close()  # its input ended
    state.offer(2, {"k": b"v"})
    state.offer(4, {"k": b"w"})
    ck.flush()
    assert Store(str(tmp_path), JOB).latest().epoch == 4
    ck.close()


def test_a_participant_registered_after_a_checkpoint_epoch_was_handed_is_refused(tmp_path):
    """A dataflow built once the worker had handed a checkpoint epoch without it would offer from
    the first epoch past the resume epoch, which is gone: its state would be in no checkpoint, and
    nothing would say so. It is refused, naming the participant and the epoch."""
    (ck,) = workers(str(tmp_path), 1)
    early = ck.register("early")
    late_but_in_time = ck.register("second")  # before any epoch was handed: fine
    early.offer(2, {"k": b"1"})
    late_but_in_time.offer(2, {})
    with pytest.raises(CheckpointError, match="'late'.*handed checkpoint epoch 2"):
        ck.register("late")
    ck.flush()
    ck.close()
    assert Store(str(tmp_path), JOB).latest().epoch == 2


def test_a_storage_error_fails_the_job_and_keeps_the_previous_checkpoint(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions")
    (ck,) = workers(str(tmp_path), 1)
    p = ck.register("s")
    p.offer(2, {"k": b"1"})
    ck.flush()
    os.chmod(tmp_path / "parts", 0o500)
    try:
        p.offer(4, {"k": b"2"})
        with pytest.raises(CheckpointError, match="parts"):
            settle([ck], lambda: False)
    finally:
        os.chmod(tmp_path / "parts", 0o700)
    ck.close()
    assert Store(str(tmp_path), JOB).latest().epoch == 2


def test_a_failing_write_names_the_file(tmp_path, monkeypatch):
    """A write that fails (here: the store raises, as on a full disk) surfaces at the next poll."""
    (ck,) = workers(str(tmp_path), 1)
    p = ck.register("s")

    def full(*args, **kwargs):
        raise CheckpointError(f"cannot write checkpoint file {tmp_path}/parts/x.part: [Errno 28] No space left")

    monkeypatch.setattr(ck.store, "write_part", full)
    p.offer(2, {"k": b"1"})
    with pytest.raises(CheckpointError, match="No space left"):
        settle([ck], lambda: False)
    ck.close()
    assert Store(str(tmp_path), JOB).latest() is None


def test_another_jobs_checkpoint_is_refused(tmp_path):
    (ck,) = workers(str(tmp_path), 1)
    p = ck.register("s")
    ck.built("df", 1)
    p.offer(2, {})
    ck.flush()
    ck.close()
    (again,) = workers(str(tmp_path), 1)
    with pytest.raises(CheckpointError, match="no participant 'other'"):
        again.register("other")
    again.register("s")
    with pytest.raises(CheckpointError, match="another job: dataflow 'df'"):
        again.built("df", 2)
    again.close()


def test_a_checkpoint_with_participants_the_job_does_not_register_is_refused(tmp_path):
    """A job that registers only some of a checkpoint's participants is another job: refused once
    its participants are final (its first handed epoch, at the next poll, or its end), naming the
    manifest and the participants it lacks."""
    (ck,) = workers(str(tmp_path), 1)
    a, b = ck.register("a"), ck.register("b")
    a.offer(2, {})
    b.offer(2, {})
    ck.flush()
    ck.close()
    (again,) = workers(str(tmp_path), 1)
    only_a = again.register("a")
    only_a.offer(4, {})  # hands epoch 4: no participant may register from now on
    with pytest.raises(CheckpointError, match=r"another job: it has participants \['b'\]"):
        again.poll()
    again.close()
    (ended,) = workers(str(tmp_path), 1)
    ended.register("a")
    with pytest.raises(CheckpointError, match="manifests/.*participants \\['b'\\]"):
        ended.flush()  # a job that ends before handing any epoch
    ended.close()
    assert Store(str(tmp_path), JOB).latest().epoch == 2


def test_worker_checkpoint_is_none_without_checkpoints():
    assert timely.execute(lambda w: w.checkpoint) == [None]


def test_source_and_sink_in_one_worker(tmp_path):
    """checkpoint.source reads epochs from the resume epoch on; checkpoint.sink writes each once."""
    read_log = []

    def read(epoch, index, peers):
        read_log.append(epoch)
        return None if epoch >= 5 else [epoch * 10 + i for i in range(3)]

    def main(worker):
        with worker.dataflow() as scope:
            checkpoint.sink(checkpoint.source(scope, "in", read), str(tmp_path / "out"), "nums")

    timely.execute(main, checkpoint=str(tmp_path / "ck"), checkpoint_every=2)
    assert read_log == [0, 1, 2, 3, 4, 5]
    got = {e: sorted(rs) for e, rs in checkpoint.read_sink(str(tmp_path / "out"), "nums").items()}
    assert got == {e: [e * 10, e * 10 + 1, e * 10 + 2] for e in range(5)}
    read_log.clear()
    timely.execute(main, checkpoint=str(tmp_path / "ck"), checkpoint_every=2)  # resumes at the last checkpoint
    assert read_log == [4, 5]
    assert checkpoint.read_sink(str(tmp_path / "out"), "nums").keys() == got.keys()


def test_restarts_resume_from_the_latest_checkpoint_and_stop_at_final_errors(tmp_path):
    """timely.recovery.run_restarting: one line per restart naming the failed worker and the resume
    epoch; a CheckpointError is not retried; the number of restarts is bounded."""
    from timely.checkpoint.checkpointer import CheckpointConfig
    from timely.cluster import Outcome
    from timely.recovery import run_restarting

    (ck,) = workers(str(tmp_path), 1)
    ck.register("s").offer(2, {})
    ck.flush()
    ck.close()
    config = CheckpointConfig(str(tmp_path), 2)
    killed = [Outcome(0, "ok"), Outcome(1, "killed", signal=9)]
    lines: list[str] = []
    runs = iter([killed, killed, [Outcome(0, "ok"), Outcome(1, "ok")]])
    attempts: list[int] = []
    outcomes = run_restarting(lambda c: attempts.append(c.attempt) or next(runs), 3, config, lines.append)
    assert [o.status for o in outcomes] == ["ok", "ok"]
    assert attempts == [0, 1, 2]  # each run names itself: its parts never join a failed run's
    assert lines == ["worker 1 was killed by signal SIGKILL; restart 1 of 3: every worker resumes from the "
                     "checkpoint of epoch 2"] + ["worker 1 was killed by signal SIGKILL; restart 2 of 3: every "
                                                "worker resumes from the checkpoint of epoch 2"]
    assert run_restarting(lambda c: killed, 1, config, lines.append) == killed  # out of restarts
    final = [Outcome(0, "error", summary="timely.checkpoint.store.CheckpointError: disk full")]
    calls = []
    run_restarting(lambda c: calls.append(1) or final, 3, config, lines.append)
    assert calls == [1]
    with pytest.raises(ValueError, match="need"):
        run_restarting(lambda c: killed, 1, None, lines.append)


def test_a_rescaled_launch_under_a_reused_token_still_commits(tmp_path):
    """The run is named by the job's token (``--token``, ``TIMELY_TOKEN``: a user may fix it), the
    number of workers and the attempt: a launch on 2 workers after one on 4 under the same token
    found the reached markers of the earlier workers 2 and 3 under its own name and never
    committed, silently."""
    from timely.checkpoint.checkpointer import CheckpointConfig

    config = CheckpointConfig(str(tmp_path), 2)
    four = [Checkpointer.open(config, i, 4, "a-fixed-token") for i in range(4)]
    for ck in four:
        ck.register("s").offer(2, {})
    settle(four, lambda: four[0].stats()["commits"] == 1)
    for ck in four:
        ck.flush()
        ck.close()
    two = [Checkpointer.open(config, i, 2, "a-fixed-token") for i in range(2)]
    assert [ck.resume_epoch for ck in two] == [2, 2]
    for ck in two:
        ck.register("s").offer(4, {f"k{ck.index}": b"v"})
    settle(two, lambda: two[0].stats()["commits"] == 1)
    for ck in two:
        ck.flush()
        ck.close()
    m = Store(str(tmp_path), JOB).latest()
    assert (m.epoch, m.peers) == (4, 2)


def test_a_missing_part_is_refused_naming_the_file(tmp_path):
    (ck,) = workers(str(tmp_path), 1)
    ck.register("s").offer(2, {"k": b"v"})
    ck.flush()
    ck.close()
    (again,) = workers(str(tmp_path), 1)
    p = again.register("s")
    name = sorted(again.manifest.files())[0]
    os.remove(tmp_path / "parts" / name)
    with pytest.raises(CheckpointError, match=name):
        p.restore()
    again.close()


def test_a_failed_local_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A write that fails part way (a full disk at fsync) raises naming the file and removes its
    temporary file, which nothing else would (the collector removes temporary parts, not these)."""
    import errno

    store = Store(str(tmp_path), JOB)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match="cannot write checkpoint file .*x.json"):
        store._write_atomic(str(tmp_path / "x.json"), b"{}")
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
