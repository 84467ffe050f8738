"""Timely jobs run as one Spark barrier stage (``spark_bridge.run``), on a local standalone cluster.

The module fixture starts a standalone master and 2 workers of 2 cores each from the pyspark
package's own ``spark-class`` (``examples/spark_standalone.py``, loopback only), then runs
``tests/spark_barrier_driver.py`` once, in a process of its own, with every scenario: each writes
what happened as JSON, and each test below checks one of them against the sequential answer of
``examples/barrier_wordcount.py`` (a word count in a Megaphone operator, optionally migrating bins)
or a plain Python count. Afterwards no process of the cluster, no timely worker and no child of
this process is left, also when a test fails.

The command line form (``python -m spark_bridge.launch``) runs on ``local[2]``; the decision a
barrier task takes from its workers' verdicts, the driver's slot check and its event listener are
tested without Spark.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from procs import no_leftover_children

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import barrier_wordcount as wc  # noqa: E402
from spark_standalone import StandaloneCluster, java_missing  # noqa: E402

import timely  # noqa: E402
from spark_bridge import barrier, barrier_link, barrier_task  # noqa: E402
from timely.checkpoint import read_sink  # noqa: E402
from timely.launch import Outcome  # noqa: E402

_why = java_missing()
needs_java = pytest.mark.skipif(_why is not None, reason=_why or "")

SCENARIOS = ["too_many", "wordcount", "megaphone", "error", "dying", "cancel", "bridge", "kill", "kill_checkpoint",
             "local"]
ERROR_JOB = """
import timely

def main(worker):
    with worker.dataflow() as scope:
        inp = scope.new_input()
        inp.stream.map(lambda x: 1 // (x - 3)).probe()
    inp.send(3 if worker.index == 1 else 4)
    inp.close()
"""

DYING_JOB = """
import os, signal

def main(worker):
    if worker.index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    worker.step_while(lambda: True, timeout=60)
"""


def _reap_driver(proc: subprocess.Popen) -> None:
    """Ctrl-C the driver (its finally stops its Spark session), kill its group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario's JSON, from one driver on a fresh standalone cluster (2 workers x 2 cores)."""
    if _why is not None:
        pytest.skip(_why)
    base = tmp_path_factory.mktemp("barrier")
    workdir = base / "spark"
    workdir.mkdir()
    (base / "error_job.py").write_text(textwrap.dedent(ERROR_JOB))
    (base / "dying_job.py").write_text(textwrap.dedent(DYING_JOB))
    out = base / "out"
    with no_leftover_children():
        cluster = StandaloneCluster(workdir, workers=2, cores=2)
        try:
            cluster.start()
            argv = [sys.executable, str(ROOT / "tests" / "spark_barrier_driver.py"), "--master", cluster.master_url,
                    "--workdir", str(workdir), "--out", str(out), "--scenarios", ",".join(SCENARIOS),
                    "--error-job", str(base / "error_job.py"), "--dying-job", str(base / "dying_job.py")]
            began = time.monotonic()
            with open(base / "driver.log", "w") as log:
                driver = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
            try:
                rc = driver.wait(290)
            finally:
                _reap_driver(driver)
            tail = (base / "driver.log").read_text()[-6000:]
            assert rc == 0, tail
            results = {name: json.loads((out / f"{name}.json").read_text()) for name in SCENARIOS}
            results["_seconds"] = round(time.monotonic() - began, 1)
            results["_executors"] = sorted(d.parent.parent.name for d in cluster.executor_dirs())
            results["_log"] = tail
            results["_work"] = str(out / "work")
            yield results
        finally:
            cluster.stop()
            left = cluster.still_running()
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            assert not left, f"Spark processes left behind: {left}"


def _ok(run: dict) -> list:
    assert "crash" not in run, run["crash"]
    assert "error" not in run, run.get("message")
    assert run["alive_after"] == [], "timely workers outlived their Spark tasks"
    return run["results"]


def _merged(results: list) -> dict[str, int]:
    merged: dict[str, int] = {}
    for r in results:
        assert not set(merged) & set(r["counts"]), "a word counted on two workers"
        merged.update(r["counts"])
    return merged


@needs_java
@pytest.mark.timeout(330)
def test_word_count_runs_as_a_barrier_stage_and_gives_the_sequential_answer(runs, record_property):
    results = _ok(runs["wordcount"])
    record_property("driver_seconds", runs["_seconds"])
    assert len(results) == 2 and runs["wordcount"]["runs"] == 1
    assert _merged(results) == wc.expected(15)
    assert [r["bins"] for r in results] == [v for _, v in sorted(wc.expected_bins(15, 2, False).items())]
    # The executors were separate JVMs, one started by each standalone worker.
    assert runs["_executors"] == ["worker-0", "worker-1"]


@needs_java
@pytest.mark.timeout(330)
def test_megaphone_migration_on_three_workers_gives_the_sequential_answer(runs):
    results = _ok(runs["megaphone"])
    assert len(results) == 3
    assert _merged(results) == wc.expected(24)
    want = wc.expected_bins(24, 3, True)
    assert want != wc.expected_bins(24, 3, False)  # bins really moved
    assert {i: r["bins"] for i, r in enumerate(results)} == want


@needs_java
@pytest.mark.timeout(330)
def test_more_workers_than_task_slots_fails_fast_with_a_clear_message(runs):
    run = runs["too_many"]
    assert run["error"] == "InsufficientSlots", run
    assert "5 timely workers need 5 Spark tasks running at once" in run["message"]
    assert "allow at most 4 task slots" in run["message"] and "ask for at most 4 workers" in run["message"]
    assert run["seconds"] < 5, run  # the settings cap the application at 4 cores: no waiting


@needs_java
@pytest.mark.timeout(330)
def test_an_error_in_the_job_is_raised_like_timely_execute_without_a_retry(runs):
    run = runs["error"]
    assert run.get("error") == "WorkerOperatorError", run
    assert run["index"] == 1 and "ZeroDivisionError" in run["message"]
    assert "ZeroDivisionError" in run["remote_traceback"]
    assert run["runs"] == 1  # the job's own error would come back: Spark is not asked to retry


@needs_java
@pytest.mark.timeout(330)
def test_a_worker_that_always_dies_fails_the_job_once_spark_gives_up(runs):
    run = runs["dying"]
    assert run.get("error") == "WorkerError", run
    assert run["index"] == 1 and run["runs"] == 3, run  # spark.stage.maxConsecutiveAttempts=3 in the driver
    assert "worker 1 was killed by signal SIGKILL, in each of the 3 runs" in run["message"]
    assert sum("the barrier stage failed; on Spark's retry" in line for line in run["log"]) == 3


@needs_java
@pytest.mark.timeout(330)
def test_no_timely_worker_outlives_its_cancelled_spark_task(runs):
    run = runs["cancel"]
    assert "crash" not in run, run["crash"]
    assert len(run["pids"]) == 2 and run["alive_after_cancel"] == [], run
    assert run["gone_seconds"] < 15, run
    assert run.get("error"), "a cancelled job must not return results"


@needs_java
@pytest.mark.timeout(330)
def test_another_spark_job_feeds_and_reads_the_job_through_the_published_coordinator(runs):
    run = runs["bridge"]
    assert "crash" not in run, run["crash"]
    assert "error" not in run, run.get("message")
    assert run["endpoint"].startswith("tcp://127.0.0.1:")
    got = {int(k): v for k, v in run["counts"].items()}
    assert got == Counter((i * 2654435761) % 200 for i in range(20_000))
    assert [r["worker"] for r in run["results"]] == [0, 1]


def _reads(log: Path, worker: int) -> list[tuple[str, int]]:
    return [(job, int(e)) for job, e in (line.split() for line in (log / f"reads-w{worker}.txt").read_text().splitlines())]


def _runs_of(log: Path, worker: int) -> list[dict]:
    return [json.loads(line) for line in (log / f"runs-w{worker}.jsonl").read_text().splitlines()]


@needs_java
@pytest.mark.timeout(330)
def test_a_killed_worker_makes_spark_retry_the_stage_from_the_inputs(runs):
    run = runs["kill"]
    results = _ok(run)
    assert run["runs"] == 2, run["log"]
    assert any("worker 1 was killed by signal SIGKILL: the barrier stage failed; on Spark's retry every worker starts "
               "again from its inputs (no checkpoints)" in line for line in run["log"]), run["log"]
    assert _merged(results) == wc.expected(40)
    log = _log_dir(runs, "kill")
    for w in (0, 1):
        first, second = (r["job"] for r in _runs_of(log, w))
        assert first != second
        again = [e for job, e in _reads(log, w) if job == second]
        assert again == list(range(40))  # no checkpoints: the second run reads everything again


@needs_java
@pytest.mark.timeout(330)
def test_a_killed_worker_resumes_from_the_checkpoint_and_no_input_is_replayed_twice(runs):
    run = runs["kill_checkpoint"]
    results = _ok(run)
    assert run["runs"] == 2, run["log"]
    assert any("worker 1 was killed by signal SIGKILL" in line for line in run["log"]), run["log"]
    resumed = [line for line in run["log"] if "every worker resumes from the checkpoint of epoch" in line]
    assert len(resumed) == 1, run["log"]
    assert _merged(results) == wc.expected(40)
    log = _log_dir(runs, "kill_checkpoint")
    for w in (0, 1):
        first, second = _runs_of(log, w)
        assert first["resume"] == 0 and second["resume"] >= 10
        assert f"epoch {second['resume']}" in resumed[0]
        reads = _reads(log, w)
        again = [e for job, e in reads if job == second["job"]]
        assert again == list(range(second["resume"], 40))  # the second run starts at the checkpoint
        below = Counter(e for _, e in reads if e < second["resume"])
        assert below == Counter(range(second["resume"])), "an input the checkpoint holds was read again"
    # The sink wrote every epoch once: the per-epoch running counts equal the sequential ones.
    out = _log_dir(runs, "kill_checkpoint").parent / "out"
    assert {e: sorted(r) for e, r in read_sink(str(out), "counts").items()} == wc.expected_records(40)


@needs_java
@pytest.mark.timeout(330)
def test_the_same_code_runs_on_local_mode(runs):
    results = _ok(runs["local"])
    assert _merged(results) == wc.expected(15)


def _log_dir(runs: dict, name: str) -> Path:
    return Path(runs["_work"]) / name / "log"


# -- the command line, on local mode --------------------------------------------------------------

def _cli(args: list[str], tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    conf = ["--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
            "--conf", "spark.ui.enabled=false"]
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with no_leftover_children():
        return subprocess.run([sys.executable, "-m", "spark_bridge.launch", *conf, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout)


@needs_java
@pytest.mark.timeout(150)
def test_the_command_line_runs_a_job_file_on_local_mode(tmp_path):
    out = tmp_path / "out"
    proc = _cli(["-w", "2", "--master", "local[2]", str(ROOT / "examples" / "barrier_wordcount.py"), "--epochs", "10",
                 "--migrate", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert {e: sorted(r) for e, r in read_sink(str(out), "counts").items()} == wc.expected_records(10)


@needs_java
@pytest.mark.timeout(150)
def test_the_command_line_refuses_more_workers_than_slots(tmp_path):
    proc = _cli(["-w", "3", "--master", "local[2]", str(ROOT / "examples" / "barrier_wordcount.py")], tmp_path)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "3 timely workers need 3 Spark tasks running at once" in proc.stderr
    assert "local[2] runs 2 tasks at once" in proc.stderr


# -- without Spark --------------------------------------------------------------------------------

def _verdict(index: int, status: str, secondary: bool = False) -> dict:
    o = Outcome(index, status, secondary=secondary, summary="ZeroDivisionError: x", signal=9)
    return {"index": index, "status": status, "secondary": secondary, "describe": o.describe()}


def test_the_tasks_retry_the_stage_only_when_a_worker_died():
    ok = _verdict(0, "ok")
    assert barrier_task.decide([ok, _verdict(1, "ok")]) == ("ok", "")
    # A worker killed, its peer lost it: retry, naming the killed one.
    assert barrier_task.decide([_verdict(0, "error", True), _verdict(1, "killed")]) == \
        ("retry", "worker 1 was killed by signal SIGKILL")
    assert barrier_task.decide([ok, _verdict(1, "exited")])[0] == "retry"
    # Only lost peers (the cause died with its task): retry.
    assert barrier_task.decide([_verdict(0, "error", True), _verdict(1, "error", True)])[0] == "retry"
    # The job's own error: final, whatever its peers saw.
    assert barrier_task.decide([_verdict(0, "error", True), _verdict(1, "error")]) == \
        ("final", "worker 1 failed: ZeroDivisionError: x")
    timeout = {"index": 0, "status": "timeout", "secondary": False, "describe": "worker 0 still running after 5 s"}
    assert barrier_task.decide([timeout, _verdict(1, "killed")]) == ("final", "worker 0 still running after 5 s")


def test_an_operator_error_travels_to_the_driver_as_a_worker_operator_error():
    cause = ZeroDivisionError("integer division by zero")
    failed = Outcome(1, "error", traceback="Traceback ...\nZeroDivisionError: integer division by zero\n",
                     summary="timely.errors.OperatorError: ...", operator="Map", cause=cause)
    answers = [barrier_task.pack(Outcome(0, "error", secondary=True, summary="PeerLost: worker 1"), {"index": 0}),
               barrier_task.pack(failed, {"index": 1})]
    outcomes = [barrier._outcome(pickle.loads(pickle.dumps(a))) for a in answers]
    err = barrier.failure_error(outcomes)
    assert isinstance(err, timely.WorkerOperatorError) and err.index == 1 and err.operator == "Map"
    assert isinstance(err.cause, ZeroDivisionError) and "Remote traceback (worker 1)" in str(err)
    ok = barrier_task.pack(Outcome(0, "ok", result={"a": 1}), {"index": 0})
    assert barrier._outcome(ok).result == {"a": 1}


def _fake_context(master: str, slots: int, conf: dict[str, str]) -> SimpleNamespace:
    class Conf:
        def get(self, key, default=None):
            return conf.get(key, default)

    jsc = SimpleNamespace(maxNumConcurrentTasks=lambda rp: slots,
                          resourceProfileManager=lambda: SimpleNamespace(defaultResourceProfile=lambda: None))
    return SimpleNamespace(master=master, getConf=Conf, defaultParallelism=slots,
                           _jsc=SimpleNamespace(sc=lambda: jsc))


def test_the_slot_check_fails_at_once_when_the_settings_cap_the_cluster():
    barrier.require_slots(_fake_context("local[4]", 4, {}), 4, 30)
    began = time.monotonic()
    with pytest.raises(barrier.InsufficientSlots, match=r"local\[4\] runs 4 tasks at once"):
        barrier.require_slots(_fake_context("local[4]", 4, {}), 5, 30)
    conf = {"spark.cores.max": "4", "spark.executor.cores": "2", "spark.task.cpus": "2"}
    with pytest.raises(barrier.InsufficientSlots, match=r"spark.task.cpus=2.*allow at most 2"):
        barrier.require_slots(_fake_context("spark://h:7077", 1, conf), 3, 30)
    assert time.monotonic() - began < 1
    with pytest.raises(barrier.InsufficientSlots, match=r"after waiting 0.3 s"):
        barrier.require_slots(_fake_context("yarn", 2, {}), 3, 0.3)
    with pytest.raises(barrier.InsufficientSlots, match="dynamic allocation"):
        barrier.require_slots(_fake_context("yarn", 8, {"spark.dynamicAllocation.enabled": "true"}), 2, 0)


def test_the_driver_link_keeps_only_events_with_the_job_key():
    seen: list[dict] = []
    link = barrier_link.DriverLink("127.0.0.1", "127.0.0.1", "k" * 32, seen.append)
    try:
        assert not barrier_link.send(None, "k" * 32, kind="run")
        assert barrier_link.send(link.address, "wrong", kind="run", run=1, coordinator="tcp://x:1")
        assert barrier_link.send(link.address, "k" * 32, kind="run", run=2, coordinator="tcp://127.0.0.1:9")
        event = link.wait_for(lambda e: e.get("kind") == "run", 5)
        assert event == {"kind": "run", "run": 2, "coordinator": "tcp://127.0.0.1:9"}
        assert link.snapshot() == [event] and seen == [event]
    finally:
        link.close()


def test_a_task_host_is_read_from_its_barrier_address():
    assert barrier_task._task_host("10.0.0.7:41234") == "10.0.0.7"
    assert barrier_task._task_host("[fe80::1]:41234") == "fe80::1"
    assert barrier_task._task_host("executor-3.cluster.local") == "executor-3.cluster.local"
