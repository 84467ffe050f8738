"""Recovery from checkpoints: workers SIGKILLed at random moments, rescaling 2 -> 3 -> 1, refusals.

The job is a keyed running count (a stateful operator that is a checkpoint participant, written
here against the public API) fed by ``checkpoint.source`` and written by ``checkpoint.sink``; its
output read back must equal the sequential computation, every record exactly once.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from procs import no_leftover_children

import megaphone  # here, not in each forked worker
import timely
from timely import ProbeHandle, checkpoint
from timely.checkpoint import CheckpointError, Store
from timely.checkpoint.checkpointer import JOB
from timely.dataflow import Capability, Exchange, OperatorBuilder
from timely.routing import hash64

ROOT = Path(__file__).resolve().parent.parent
KEYS = 13
PER_EPOCH = 12


def records(epoch: int) -> list[tuple[str, int]]:
    """Every worker's records of ``epoch`` together (deterministic)."""
    return [(f"k{(epoch * 7 + i * 5) % KEYS}", 1 + (epoch + i) % 3) for i in range(PER_EPOCH)]


def reader(epochs: int, pause: float = 0.0):
    """``read`` for checkpoint.source: worker ``index``'s share of ``records(epoch)``."""
    def read(epoch: int, index: int, peers: int):
        if epoch >= epochs:
            return None
        if pause:
            time.sleep(pause)
        return records(epoch)[index::peers]

    return read


def expected(epochs: int) -> dict[int, list]:
    """The sequential computation: per epoch, ``(key, running sum)`` of the keys seen in it."""
    sums: dict[str, int] = {}
    out: dict[int, list] = {}
    for e in range(epochs):
        seen = set()
        for k, v in records(e):
            sums[k] = sums.get(k, 0) + v
            seen.add(k)
        out[e] = sorted((k, sums[k]) for k in seen)
    return out


def running_sum(stream, name: str):
    """Per epoch, ``(key, running sum)`` of the keys seen in it: state checkpointed per key.

    The participant's cut: epoch ``e`` is offered before any epoch ``>= e`` is applied and once
    every epoch before ``e`` is (epochs are applied in order, once complete)."""
    scope = stream.scope
    ck = scope.worker.checkpoint
    p = None if ck is None else ck.register(name)
    sums: dict[str, int] = {}
    if p is not None:  # load the keys this worker owns now (the exchange's routing: rescaling too)
        mine = [k for k in p.keys() if hash64(k) % scope.peers == scope.index]
        sums = {k: pickle.loads(v) for k, v in p.restore(mine).items()}
    dirty: set[str] = set()
    start = 0 if ck is None else ck.resume_epoch
    nxt = [start]  # the next checkpoint epoch candidate (offered once passed)
    b = OperatorBuilder(scope, name)
    inp = b.new_input(stream, Exchange(0))
    out, result = b.new_output()
    b.set_frontier_interest(True)
    pending: dict[int, tuple[Capability, list]] = {}

    def offer_through(limit: int) -> None:
        """Offer every checkpoint epoch <= limit not offered yet (state reflects the epochs < it)."""
        if p is None:
            return
        while nxt[0] <= limit:
            e = nxt[0]
            if ck.is_checkpoint(e) and e > start:
                p.offer(e, {k: pickle.dumps(sums[k]) for k in sorted(dirty)})
                dirty.clear()
            nxt[0] += 1

    def build(caps):
        caps[0].drop()

        def run():
            for cap, batch in inp:
                if cap.time not in pending:
                    pending[cap.time] = (cap.retain(), [])
                pending[cap.time][1].extend(batch)
            frontier = inp.frontier
            for t in sorted(t for t in pending if not frontier.less_equal(t)):
                offer_through(t)
                held, batch = pending.pop(t)
                seen = set()
                for k, v in batch:
                    sums[k] = sums.get(k, 0) + v
                    dirty.add(k)
                    seen.add(k)
                out.give_batch(held, sorted((k, sums[k]) for k in seen))
                held.drop()
            low = list(frontier)
            if low:
                offer_through(min(low))
            elif p is not None and not p.closed:
                offer_through(nxt[0] if not dirty else -(-nxt[0] // ck.every) * ck.every)
                p.close()

        return run

    b.build(build)
    return result


def count_fold(key, value, state):
    state = (state or 0) + 1
    return state, [(key, state)]


def expected_counts(epochs: int) -> dict[int, list]:
    """The sequential computation of :func:`megaphone_counts`: per record, ``(key, running count)``."""
    counts: dict[str, int] = {}
    out: dict[int, list] = {}
    for e in range(epochs):
        out[e] = []
        for k, _ in records(e):
            counts[k] = counts.get(k, 0) + 1
            out[e].append((k, counts[k]))
        out[e].sort()
    return out


def read_moves(epochs: int):
    """Megaphone's control input: worker 0 moves a bin every third epoch, copied ahead (precopy) in
    the epoch before, and asks for a standby replica of another bin in the epoch after (refreshed
    at every data time: kills land in refreshes too; replicas are not checkpointed)."""
    def read(epoch: int, index: int, peers: int):
        if epoch >= epochs:
            return None
        if index == 0 and epoch % 3 == 0:
            return [("precopy", (epoch + 1) % 8, ((epoch + 1) // 3) % peers)]
        if index == 0 and epoch % 3 == 2:
            return [("replica", (epoch + 3) % 8, ((epoch + 3) % 8 + 1) % peers)]  # (not its first owner)
        return [("move", epoch % 8, (epoch // 3) % peers)] if index == 0 and epoch % 3 == 1 else []

    return read


def megaphone_counts(stream, probe, epochs: int):
    """A Megaphone keyed running count (bins migrating under it): its bins are the checkpointed state."""
    control = checkpoint.source(stream.scope, "moves", read_moves(epochs), probe=probe)
    return megaphone.state_machine(stream, control, None, count_fold, k=3, name="Counts").stream


def stop_once_checkpointed(url: str, epoch: int) -> None:
    """SIGTERM this process once the checkpoint at ``url`` reaches ``epoch`` (the job is stopped)."""
    def watch():
        while True:
            m = Store(url, JOB).latest()
            if m is not None and m.epoch >= epoch:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


def job(worker, out: str, epochs: int, pause: float = 0.0, kill: tuple | None = None, mega: bool = False,
        stop: tuple | None = None):
    """The keyed running sum (``mega``: Megaphone's keyed running count) from checkpoint.source to
    checkpoint.sink. ``kill``: ``(marker file, worker, delay)``: on the first run only, that worker
    SIGKILLs itself ``delay`` s after start. ``stop``: ``(checkpoint url, epoch)``: worker 0 stops
    the job once that checkpoint exists."""
    if stop is not None and worker.index == 0:
        stop_once_checkpointed(*stop)
    if kill is not None:
        marker, victim, delay = kill
        if worker.index == victim and not os.path.exists(marker):
            Path(marker).write_text(json.dumps({"resume": worker.checkpoint.resume_epoch, "kill": time.time() + delay}))
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        elif worker.index == 0 and os.path.exists(marker) and not os.path.exists(marker + ".again"):
            Path(marker + ".again").write_text(json.dumps(time.time()))
    megaphone.precopy.MIN_ENTRIES = 0  # copy every bin ahead, however small (kills land in copies too)
    megaphone.precopy.REFRESH = 0.0  # the replicas' refreshes as often as data come
    probe = ProbeHandle()
    with worker.dataflow() as scope:
        s = checkpoint.source(scope, "input", reader(epochs, pause), max_in_flight=2, probe=probe)
        result = megaphone_counts(s, probe, epochs) if mega else running_sum(s, "sums")
        checkpoint.sink(result, out, "sums", probe=probe)
    worker.step_while(lambda: not probe.done(), timeout=60)


def output(url: str) -> dict[int, list]:
    return {e: sorted(rs) for e, rs in checkpoint.read_sink(url, "sums").items()}


def test_uninterrupted_run_matches_the_sequential_computation(tmp_path):
    out = str(tmp_path / "out")
    timely.execute(lambda w: job(w, out, 12), workers=1, checkpoint=str(tmp_path / "ck"), checkpoint_every=3)
    assert output(out) == expected(12)
    manifest = Store(str(tmp_path / "ck"), JOB).latest()
    assert manifest is not None and manifest.epoch == 12  # the last one: the stream ended at it


@pytest.mark.timeout(300)
def test_twenty_runs_each_killing_a_random_worker(tmp_path, monkeypatch, capfd):
    """Megaphone's keyed count, its bins copied ahead and migrating every third epoch, with standby
    replicas: SIGKILL a random worker at a random moment (writes are slowed, so some kills land in
    one; others land in a migration, a copy ahead or a refresh): every
    run recovers, and its output is the sequential computation's, every epoch once."""
    monkeypatch.setenv("TIMELY_CHECKPOINT_TEST_DELAY", "0.02")
    rng = random.Random(16)
    epochs = 16
    want = expected_counts(epochs)
    with no_leftover_children():
        for run in range(20):
            workers = rng.choice([2, 3])
            base = tmp_path / f"run{run}"
            out, marker = str(base / "out"), str(base / "killed")
            kill = (marker, rng.randrange(workers), rng.uniform(0.0, 0.3))
            timely.execute(lambda w, o=out, k=kill: job(w, o, epochs, 0.01, k, mega=True), workers=workers, timeout=30,
                           checkpoint=str(base / "ck"), checkpoint_every=rng.choice([2, 3, 4]), restarts=2)
            assert os.path.exists(marker), f"run {run}: the victim never started"
            got = output(out)
            assert got == want, f"run {run} (workers={workers}, kill={kill}): output differs"
    err = capfd.readouterr().err
    restarts = [line for line in err.splitlines() if "restart 1 of 2" in line]
    assert len(restarts) >= 15, err[-3000:]  # a kill after the job ended restarts nothing
    assert all("was killed by signal SIGKILL" in line for line in restarts), restarts


def test_rescale_two_three_one_through_checkpoints(tmp_path):
    """Stop a 2-worker run midway (once a checkpoint exists), go on with 3 workers, stop again,
    finish with 1: the output equals one uninterrupted run's."""
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    epochs = 40
    with no_leftover_children():
        for workers, target in ((2, 10), (3, 24)):
            with pytest.raises(timely.WorkerError, match="worker 0 was killed by signal SIGTERM"):
                timely.execute(lambda w, t=target: job(w, out, epochs, 0.03, stop=(ck, t)), workers=workers,
                               timeout=30, checkpoint=ck, checkpoint_every=2)
            m = Store(ck, JOB).latest()
            assert m is not None and m.peers == workers and target <= m.epoch < epochs, m
        timely.execute(lambda w: job(w, out, epochs, 0.0), workers=1, checkpoint=ck, checkpoint_every=2)
    assert output(out) == expected(epochs)


def test_a_manifest_cut_short_is_passed_over_and_the_job_resumes_from_the_one_before(tmp_path, capfd):
    """On a store without atomic writes a crash can leave the newest manifest half written: the
    next run resumes from the newest intact checkpoint, and its output is still exactly once."""
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    epochs = 30
    with no_leftover_children():
        with pytest.raises(timely.WorkerError, match="worker 0 was killed by signal SIGTERM"):
            timely.execute(lambda w: job(w, out, epochs, 0.03, stop=(ck, 12)), workers=2, timeout=30,
                           checkpoint=ck, checkpoint_every=2)
        manifests = sorted((tmp_path / "ck" / "manifests").glob("*.json"))
        assert len(manifests) == 2, manifests
        newest = manifests[-1]
        newest.write_bytes(newest.read_bytes()[:100])
        assert Store(ck, JOB).latest().path.endswith(manifests[0].name)
        timely.execute(lambda w: job(w, out, epochs, 0.0), workers=2, checkpoint=ck, checkpoint_every=2)
    assert output(out) == expected(epochs)
    assert f"{newest.name} is cut short" in capfd.readouterr().err


def other_job(worker, out: str):
    with worker.dataflow() as scope:
        s = checkpoint.source(scope, "input", reader(4))
        checkpoint.sink(s.map(lambda r: r).filter(lambda r: True), out, "other")


def test_a_checkpoint_of_another_job_is_refused(tmp_path):
    ck = str(tmp_path / "ck")
    timely.execute(lambda w: job(w, str(tmp_path / "out"), 6), checkpoint=ck, checkpoint_every=2)
    with pytest.raises(CheckpointError, match="another job"):
        timely.execute(lambda w: other_job(w, str(tmp_path / "o2")), checkpoint=ck, checkpoint_every=2)


def test_a_corrupt_part_is_refused_naming_the_file(tmp_path):
    ck = str(tmp_path / "ck")
    timely.execute(lambda w: job(w, str(tmp_path / "out"), 6), checkpoint=ck, checkpoint_every=2)
    m = Store(ck, JOB).latest()
    part = tmp_path / "ck" / "parts" / sorted(m.files())[0]
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=part.name):
        timely.execute(lambda w: job(w, str(tmp_path / "out"), 6), checkpoint=ck, checkpoint_every=2)


def test_launcher_restarts_a_killed_worker(tmp_path):
    """``python -m timely.launch --checkpoint DIR --restarts R``: a worker SIGKILLed mid-stream is
    noticed at once (the restarted job runs well within the 30 s heartbeat timeout of the kill), the job restarts from the
    checkpoint and the output is exactly once."""
    out, marker = tmp_path / "out", tmp_path / "killed"
    jobfile = tmp_path / "job.py"
    jobfile.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_checkpoint_recovery import job

        def main(worker):
            job(worker, {str(out)!r}, 30, 0.02, ({str(marker)!r}, 1, 0.3))
    """))
    cmd = [sys.executable, "-m", "timely.launch", "-w", "2", "--checkpoint", str(tmp_path / "ck"),
           "--checkpoint-every", "3", "--restarts", "1", "--timeout", "40", str(jobfile)]
    with no_leftover_children():
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "restart 1 of 1" in line]
    assert len(lines) == 1 and "worker 1 was killed by signal SIGKILL" in lines[0], proc.stderr
    first = json.loads(Path(marker).read_text())
    assert first["resume"] == 0
    again = json.loads(Path(f"{marker}.again").read_text())
    # Noticed at once, not after the 30 s heartbeat timeout (the bound is loose: a loaded machine is slow)
    assert again - first["kill"] < 15.0  # the others stopped and every worker started again
    assert output(str(out)) == expected(30)


def test_a_checkpoint_is_complete_only_once_the_sink_wrote_the_epochs_before_it(tmp_path, monkeypatch):
    """The source runs ahead (no probe) of a sink that is slow on worker 1: at every commit, the
    sink's files of all epochs before the committed one are written, so a crash right after it
    loses no output (the sink takes part in checkpoints; before, the sources alone decided them,
    and commits in the middle of the run found epochs unwritten)."""
    out, ck_dir = str(tmp_path / "out"), str(tmp_path / "ck")
    commits: list[tuple[int, list[int]]] = []  # worker 0's: (epoch, sink epochs below it not all written)
    real_commit = Store.commit

    def commit(self, epoch, peers, parts):
        manifest = real_commit(self, epoch, peers, parts)
        written = checkpoint.read_sink(out, "numbers")
        commits.append((epoch, [e for e in range(epoch) if len(written.get(e, ())) < 16]))
        return manifest

    monkeypatch.setattr(Store, "commit", commit)  # (forked workers inherit it)

    def main(worker):
        if worker.index == 1:
            import fsspec.implementations.local as local

            real_pipe = local.LocalFileSystem.pipe_file

            def slow_pipe(self, path, value, **kwargs):
                time.sleep(0.03)
                return real_pipe(self, path, value, **kwargs)

            local.LocalFileSystem.pipe_file = slow_pipe
        with worker.dataflow() as scope:
            stream = checkpoint.source(scope, "numbers", lambda e, i, p: list(range(8 * e, 8 * e + 8)) if e < 40 else None)
            probe = checkpoint.sink(stream, out, "numbers", slots=4)
        worker.step_while(lambda: not probe.done(), timeout=60)
        worker.checkpoint.flush()  # the last commit, before the result is taken
        return list(commits)

    seen = timely.execute(main, workers=2, checkpoint=ck_dir, checkpoint_every=5, timeout=120)[0]
    assert seen and all(not missing for _, missing in seen), seen
    assert {e: sorted(r) for e, r in checkpoint.read_sink(out, "numbers").items()} == {
        e: sorted(list(range(8 * e, 8 * e + 8)) * 2) for e in range(40)}


def test_a_checkpoint_error_inside_an_operator_is_not_retried():
    """A full disk under the exactly-once sink fails its operator with a CheckpointError: the
    worker's failure is an OperatorError, and a restart would fail again."""
    from timely.cluster import Outcome
    from timely.recovery import retryable

    class DiskFull(CheckpointError):
        pass

    def failed(summary: str, cause: BaseException | None) -> Outcome:
        return Outcome(0, status="error", summary=summary, cause=cause)

    sink_full = DiskFull("sink 'out': cannot write: No space left on device")
    assert not retryable(failed("OperatorError: worker 0: operator 'Sink' failed: DiskFull(...)", sink_full))
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = sink_full
    assert not retryable(failed("OperatorError: worker 0: operator 'Sink' failed: RuntimeError(...)", wrapped))
    assert not retryable(failed("timely.checkpoint.store.CheckpointError: corrupt manifest", None))
    assert retryable(failed("OperatorError: worker 0: operator 'Map' failed: ValueError(...)", ValueError("x")))
    assert retryable(Outcome(0, status="killed", signal=9))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source_on", [0, 1])
def test_a_worker_whose_inputs_ended_holds_no_checkpoint_back(tmp_path, source_on):
    """A replayable source with records on one worker only: the other worker's participant closes
    at once, and its final marker lets checkpoints commit while the job runs (they waited for that
    worker until the job ended). Worker 0 may be either one: it still checks for commits."""
    ck = str(tmp_path / "ck")

    def read(epoch, index, peers):
        if index != source_on or epoch >= 40:
            return None
        time.sleep(0.02)
        return [epoch]

    def main(worker):
        with worker.dataflow() as scope:
            checkpoint.source(scope, "a", read).map(lambda r: r)
        seen = set()
        while worker.step_or_park(0.01):
            if worker.index == 0:
                m = Store(ck, JOB).latest()
                if m is not None:
                    seen.add(m.epoch)
        return sorted(seen)

    during = timely.execute(main, workers=2, checkpoint=ck, checkpoint_every=5, timeout=100)[0]
    assert during and min(during) < 35, during  # committed while the source ran, not only at its end


def test_a_participant_registered_after_the_worker_went_final_is_refused(tmp_path):
    def main(worker):
        with worker.dataflow() as scope:
            checkpoint.source(scope, "a", lambda epoch, index, peers: None).map(lambda r: r)
        worker.step_while(worker.has_dataflows, timeout=20)  # its only participant closed: final
        with worker.dataflow() as scope:
            checkpoint.source(scope, "b", lambda epoch, index, peers: None)

    with pytest.raises(CheckpointError, match="participant 'source/b' registered on worker 0 after every earlier participant"):
        timely.execute(main, workers=1, checkpoint=str(tmp_path / "ck"), checkpoint_every=5)
