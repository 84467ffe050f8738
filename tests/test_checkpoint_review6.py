"""Review 6 of checkpoints: an epoch limit in a source followed by a continued (rescaled) run, a
process-local checkpoint URL, a foreign Megaphone checkpoint, a reused token across 2 -> 3 -> 2
workers, temporary files of killed writes, and worker 0's last commit when the last epochs are
the other workers'."""
from __future__ import annotations

import os
import time

import pytest
from procs import no_leftover_children
from test_checkpoint_recovery import expected, expected_counts, job, output
from test_checkpointer import settle

import megaphone
import timely
from timely import ProbeHandle, checkpoint
from timely.checkpoint import Checkpointer, CheckpointError, Store
from timely.checkpoint.checkpointer import JOB, CheckpointConfig
from timely.checkpoint.sources import _start

# -- 1. an epoch limit, then a continued and rescaled run ---------------------------------------------

@pytest.mark.timeout(200)
@pytest.mark.parametrize("mega", [False, True])
def test_a_run_stopped_by_an_epoch_limit_then_continued_rescaled_reads_every_epoch(tmp_path, mega):
    """README: an epoch limit in the source is a way to stop a job before rescaling it. The limit
    (12) is no checkpoint epoch (every 5): the stateful operator offers its last changes at 15,
    so the last checkpoint is of epoch 15; the continued run (30 epochs, 3 workers) must read the
    epochs 12 .. 14, which no run has read (it resumed at 15 and skipped them)."""
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    with no_leftover_children():
        timely.execute(lambda w: job(w, out, 12, mega=mega), workers=2, checkpoint=ck, checkpoint_every=5, timeout=60)
        m = Store(ck, JOB).latest()
        assert (m.epoch, m.peers) == (15, 2)
        assert {w: v["source/input"] for w, v in m.meta.items()} == {0: {"ended": 12}, 1: {"ended": 12}}
        timely.execute(lambda w: job(w, out, 30, mega=mega), workers=3, checkpoint=ck, checkpoint_every=5, timeout=60)
    assert output(out) == (expected_counts(30) if mega else expected(30))


def test_the_epoch_a_source_resumes_at():
    """The checkpoint's epoch, or the latest epoch the workers' streams ended at when earlier; a
    worker still reading at the cut (meta None) or no record at all: the checkpoint's epoch."""
    assert _start(15, {0: {"ended": 12}, 1: {"ended": 12}}) == 12
    assert _start(15, {0: {"ended": 9}, 1: {"ended": 13}}) == 13  # what worker 1 read is not read again
    assert _start(15, {0: {"ended": 12}, 1: None}) == 15
    assert _start(15, {0: {"ended": 20}}) == 15
    assert _start(15, {}) == 15


def test_a_worker_whose_source_ended_after_its_newest_part_records_the_end_in_a_last_part(tmp_path):
    """Worker 1's source ends at 7 after its part of 5, and nothing of it changes: its last part,
    at 10, records the end, so the checkpoint of 15 (cut where worker 0 went on) has it. Without
    it the checkpoint held worker 1's meta of 5 (still reading) and a resumed source began at 15."""
    url = str(tmp_path)
    cks = [Checkpointer(Store(url, JOB, run="r"), 5, i, 2) for i in range(2)]
    sources = [ck.register("source/in") for ck in cks]
    states = [ck.register("st") for ck in cks]
    for w in range(2):
        sources[w].offer(5, {})
        states[w].offer(5, {f"k{w}": b"5"})
    settle(cks, lambda: cks[0].stats()["commits"] == 1)
    sources[1].close({"ended": 7})
    states[1].close()  # nothing changed since 5
    sources[0].offer(10, {})
    states[0].offer(10, {})
    sources[0].close({"ended": 13})
    states[0].offer(15, {"k0": b"15"})
    states[0].close()
    for ck in cks:
        ck._queue.join()
    settle(cks, lambda: cks[0].stats()["commits"] == 2)
    for ck in cks:
        ck.close()
    m = Store(url, JOB).latest()
    assert m.epoch == 15 and {w: v["source/in"] for w, v in m.meta.items()} == {0: {"ended": 13}, 1: {"ended": 7}}
    again = Checkpointer(Store(url, JOB), 5, 0, 3)
    assert _start(again.resume_epoch, again.register("source/in").meta()) == 13
    again.close()


# -- 2. a process-local checkpoint URL ------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_process_local_checkpoint_url_with_worker_processes_is_refused_and_not_retried(tmp_path, capfd):
    """``memory://`` is each process's own: the workers never saw each other's parts, and no
    checkpoint was ever committed, silently."""
    with no_leftover_children(), pytest.raises(timely.WorkerError) as info:
        timely.execute(lambda w: job(w, str(tmp_path / "out"), 10), workers=2, checkpoint="memory://rv6-ck",
                       checkpoint_every=5, timeout=40, restarts=2)
    assert "CheckpointError" in str(info.value) and "'memory://rv6-ck' is local to each process" in str(info.value)
    assert "restart 1" not in capfd.readouterr().err
    # One worker in this process: its memory is the job's whole storage (allowed).
    one = Checkpointer.open(CheckpointConfig("memory://rv6-one", 5), 0, 1, "job")
    one.close()
    with pytest.raises(CheckpointError, match="memory://rv6-two.*2 worker processes"):
        Checkpointer.open(CheckpointConfig("memory://rv6-two", 5), 0, 2, "job")


# -- 3. a Megaphone checkpoint of another job ----------------------------------------------------------

def megaphone_job(k: int):
    def main(worker):
        probe = ProbeHandle()
        with worker.dataflow() as scope:
            s = checkpoint.source(scope, "in", lambda e, i, p: None if e >= 10 else [(f"k{e}", 1)], probe=probe)
            ctl = checkpoint.source(scope, "moves", lambda e, i, p: None if e >= 10 else [], probe=probe)
            m = megaphone.state_machine(s, ctl, None, lambda key, v, st: ((st or 0) + v, []), k=k, name="C")
            m.stream.probe_with(probe)
        worker.step_while(lambda: not probe.done(), timeout=30)

    return main


@pytest.mark.timeout(120)
def test_a_megaphone_checkpoint_with_another_k_is_a_final_checkpoint_error(tmp_path, capfd):
    """It raised MegaphoneError, which recovery retried (restart 1 of 3, ...), though a foreign
    checkpoint is refused with a CheckpointError, not retried."""
    ck = str(tmp_path / "ck")
    with no_leftover_children():
        timely.execute(megaphone_job(3), workers=2, checkpoint=ck, checkpoint_every=5, timeout=30)
        with pytest.raises(timely.WorkerError, match="CheckpointError: checkpoint .* belongs to another job: "
                                                     r"Megaphone operator 'C' has 2\^4 bins \(k=4\), the checkpoint's 2\^3"):
            timely.execute(megaphone_job(4), workers=2, checkpoint=ck, checkpoint_every=5, timeout=30, restarts=3)
    assert "restart 1" not in capfd.readouterr().err


def test_a_megaphone_checkpoint_with_an_unfit_table_is_a_checkpoint_error(tmp_path):
    """The table path (TableError) is a CheckpointError too, naming the manifest."""
    ck = str(tmp_path / "ck")
    store = Store(ck, JOB)
    meta = {"source/in": None, "source/moves": None, "megaphone/C": {"k": 3, "peers": 1, "table": [7] * 8}}
    store.write_part(5, 0, {}, meta)
    found = store.committable(1)
    manifest = store.commit(found[0], 1, found[1])
    with pytest.raises(CheckpointError, match=f"checkpoint {manifest.path}: Megaphone operator 'C': "):
        timely.execute(megaphone_job(3), workers=1, checkpoint=ck, checkpoint_every=5)


# -- 4. a reused token, 2 -> 3 -> 2 workers --------------------------------------------------------------

def test_a_launch_under_a_reused_token_does_not_meet_an_earlier_launch_of_as_many_workers(tmp_path):
    """Launch A (2 workers) commits 10 and leaves worker 0's part of 20 uncommitted; B (3 workers)
    commits nothing; C (2 workers, the same token) resumes from 10: A's leftover part of worker 0
    joined C's commit of 20 as soon as C's worker 1 reached 20 (the run was named token/2/0 in
    both)."""
    config = CheckpointConfig(str(tmp_path), 10)
    a = [Checkpointer.open(config, i, 2, "fixed-token") for i in range(2)]
    pa = [ck.register("s") for ck in a]
    for w in range(2):
        pa[w].offer(10, {f"k{w}": b"A10"})
    settle(a, lambda: a[0].stats()["commits"] == 1)
    pa[0].offer(20, {"k0": b"A20-leftover"})  # A stops before worker 1 reaches 20
    a[0]._queue.join()
    for ck in a:
        ck.close()
    b = [Checkpointer.open(config, i, 3, "fixed-token") for i in range(3)]
    for ck in b:
        ck.close()
    c = [Checkpointer.open(config, i, 2, "fixed-token") for i in range(2)]
    assert [ck.resume_epoch for ck in c] == [10, 10]
    pc = [ck.register("s") for ck in c]
    pc[1].offer(20, {"k1": b"C20"})
    c[1]._queue.join()
    assert c[0].store.committable(2) is None  # C's worker 0 has not reached 20
    pc[0].offer(20, {"k0": b"C20"})
    settle(c, lambda: c[0].stats()["commits"] == 1)
    for ck in c:
        ck.close()
    m = Store(str(tmp_path), JOB).latest()
    assert m.epoch == 20 and Store(str(tmp_path), JOB).read(m, "s") == {"k0": b"C20", "k1": b"C20"}


# -- 5. temporary files of killed writes --------------------------------------------------------------

def test_temporary_files_of_killed_writes_are_collected_but_not_those_of_writes_in_progress(tmp_path):
    """A SIGKILL inside Store._write_atomic leaves its temporary file: the collector removed those of
    parts (of committed epochs), never those of manifests or reached markers."""
    d = str(tmp_path)
    store = Store(d, JOB, run="r1")
    mine = os.path.basename(store._path("pending", f"r-w00001-{store._run}.json"))
    dead = {
        "manifests/00000000000000000010.json.tmp-deadbeef",  # a dead committer's, of a committed epoch
        "manifests/00000000000000000090.json.tmp-deadbeef",  # ... of a later epoch, before the newest manifest
        "pending/r-w00000-0123456789ab.json.tmp-deadbeef",  # another (dead) run's reached marker
        "pending/e00000000000000000010-w00000-0123456789ab.json.tmp-deadbeef",
        "parts/e00000000000000000010-w00000-aaaa.part.tmp-deadbeef",
    }
    alive = {
        f"pending/{mine}.tmp-cafecafe",  # this run's worker 1 moving its reached marker now
        "parts/e00000000000000000050-w00001-bbbb.part.tmp-cafecafe",  # a part above the newest manifest
        "pending/e00000000000000000050-w00001-0123456789ab.json.tmp-cafecafe",
    }
    for p in dead | alive:
        with open(os.path.join(d, p), "wb") as f:
            f.write(b"x" * 100)
    past = time.time() - 60
    os.utime(os.path.join(d, "manifests/00000000000000000090.json.tmp-deadbeef"), (past, past))
    for e in (10, 20, 30, 40):
        store.write_part(e, 0, {"st": {"k": b"v%d" % e}}, {})
        found = store.committable(1)
        store.commit(found[0], 1, found[1])
    left = {f"{sub}/{n}" for sub in ("manifests", "parts", "pending") for n in os.listdir(os.path.join(d, sub))
            if ".tmp-" in n}
    assert left == alive


# -- the last commit when the last epochs are the other workers' ---------------------------------------------

@pytest.mark.timeout(120)
def test_worker_0_waits_for_the_others_last_epochs_when_its_own_ended_first(tmp_path):
    """Worker 0's source has no records: worker 0 is final from the start, and its flush waited for
    a final commit only if its own newest epoch was uncommitted. Worker 1's last part (slowed
    here) came after worker 0 had left: no checkpoint of the job's end (the last one was 20)."""
    ck = str(tmp_path / "ck")

    def read(epoch, index, peers):
        if index == 0 or epoch >= 23:
            return None
        time.sleep(0.01)
        return [epoch]

    def main(worker):
        if worker.index == 1:
            worker.checkpoint._delay = 0.4  # its writes are slow
        with worker.dataflow() as scope:
            checkpoint.source(scope, "a", read).map(lambda r: r)

    with no_leftover_children():
        timely.execute(main, workers=2, checkpoint=ck, checkpoint_every=5, timeout=100)
    m = Store(ck, JOB).latest()
    assert m.epoch == 25, m
    assert {w: v["source/a"] for w, v in m.meta.items()} == {0: {"ended": 0}, 1: {"ended": 23}}
