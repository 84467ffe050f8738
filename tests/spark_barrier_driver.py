"""The Spark driver of ``tests/test_spark_barrier.py``, in a process of its own (one process holds
one SparkContext, and the test session may hold a local one already).

    python tests/spark_barrier_driver.py --master URL --workdir DIR --out DIR --scenarios a,b,... \\
        [--error-job FILE] [--dying-job FILE]

Runs timely jobs through ``spark_bridge.run`` / ``submit`` on ``--master`` (with ``--workdir``: a
standalone cluster of ``examples/spark_standalone.py``, whose session settings it uses), one
scenario after another, and writes what happened to ``OUT/<scenario>.json``: the workers' results,
or the error raised, the runs (Spark stage attempts) the job took, the lines the job logged, and the
timely worker processes still alive afterwards (there must be none). The ``kill`` scenarios SIGKILL
timely worker 1 mid-run: ``kill`` once it has read 8 epochs, ``kill_checkpoint`` once a checkpoint
of epoch >= 10 exists. ``cancel`` cancels a running job and watches its workers die; ``dying``
runs a job whose worker 1 always dies, ``error`` one whose worker 1 raises. The ``local`` scenario
stops the session and runs the word count on ``local[3]``. Comparing with the sequential answers is
the test's business.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import spark_bridge  # noqa: E402
from spark_bridge.barrier import BarrierJob, published, submit  # noqa: E402
from spark_bridge.session import local_session  # noqa: E402

JOB = str(ROOT / "examples" / "barrier_wordcount.py")
PIPELINE = str(ROOT / "examples" / "spark_pipeline.py")
ROWS, KEYS = 20_000, 200


def alive(pids: list[int]) -> list[int]:
    """The pids that still name a live (not zombie) process."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            continue
    return out


def logged_pids(log: Path) -> list[int]:
    """The pids of every timely worker of a job run with ``--log log``."""
    return [json.loads(line)["pid"] for f in sorted(log.glob("runs-w*.jsonl")) for line in f.read_text().splitlines()]


def finish(job: BarrierJob, lines: list[str], log: Path | None, timeout: float = 150.0) -> dict[str, Any]:
    """Wait for ``job``; its results (or error), runs, log lines and leftover processes."""
    out: dict[str, Any] = {"log": lines}
    began = time.monotonic()
    try:
        out["results"] = job.result(timeout)
    except BaseException as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)
        out["index"] = getattr(e, "index", None)
        out["remote_traceback"] = getattr(e, "remote_traceback", None)
    out["wait_seconds"] = round(time.monotonic() - began, 2)
    out["runs"] = job.runs()
    if log is not None:
        time.sleep(0.5)  # the tasks have reaped their workers before answering; give /proc a moment
        out["alive_after"] = alive(logged_pids(log))
    return out


def kill_when(ready: Callable[[], bool], log: Path, worker: int, timeout: float = 60.0) -> dict[str, Any]:
    """Once ``ready()``, SIGKILL the newest process of timely worker ``worker`` (from its run log)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError("the job never got far enough to be killed")
        time.sleep(0.02)
    pid = json.loads((log / f"runs-w{worker}.jsonl").read_text().splitlines()[-1])["pid"]
    os.kill(pid, signal.SIGKILL)
    return {"killed": pid}


def scenario(name: str, spark: Any, work: Path, error_job: str | None, dying_job: str | None) -> dict[str, Any]:
    lines: list[str] = []
    log = work / name / "log"
    began = time.monotonic()
    if name == "wordcount":
        out = finish(submit(spark, JOB, 2, ["--epochs", "15", "--log", str(log)], log=lines.append), lines, log)
    elif name == "megaphone":
        out = finish(submit(spark, JOB, 3, ["--epochs", "24", "--migrate", "--log", str(log)], log=lines.append),
                     lines, log)
    elif name == "too_many":
        try:
            spark_bridge.run(spark, JOB, 5, slot_wait=20.0)
            out = {"results": "ran"}
        except Exception as e:
            out = {"error": type(e).__name__, "message": str(e)}
    elif name == "error":
        assert error_job is not None
        out = finish(submit(spark, error_job, 2, log=lines.append), lines, None)
    elif name == "dying":
        assert dying_job is not None
        out = finish(submit(spark, dying_job, 2, log=lines.append), lines, None)
    elif name == "cancel":
        out = cancel(spark, log, lines)
    elif name == "bridge":
        out = bridge(spark, work / name, lines)
    elif name in ("kill", "kill_checkpoint"):
        ck = str(work / name / "ck") if name == "kill_checkpoint" else None
        args = ["--epochs", "40", "--pause", "0.05", "--log", str(log), "--out", str(work / name / "out")]
        job = submit(spark, JOB, 2, args, checkpoint=ck, checkpoint_every=5, log=lines.append)
        if ck is None:
            def ready() -> bool:
                reads = log / "reads-w1.txt"
                return reads.exists() and len(reads.read_text().splitlines()) >= 8
        else:
            from timely.checkpoint import Store

            def ready() -> bool:
                m = Store(ck, "timely").latest()
                return m is not None and m.epoch >= 10
        killed = kill_when(ready, log, 1)
        out = {**killed, **finish(job, lines, log)}
    else:
        raise ValueError(f"unknown scenario {name!r}")
    out["seconds"] = round(time.monotonic() - began, 2)
    return out


def cancel(spark: Any, log: Path, lines: list[str]) -> dict[str, Any]:
    """Cancel a job that would run for hours once both workers run: Spark kills the tasks, and
    their timely workers die with them."""
    job = submit(spark, JOB, 2, ["--epochs", "100000", "--pause", "0.05", "--log", str(log)], log=lines.append)
    deadline = time.monotonic() + 60
    while len(logged_pids(log) if log.exists() else []) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the workers never started")
        time.sleep(0.05)
    pids = logged_pids(log)
    time.sleep(0.5)
    job.cancel()
    began = time.monotonic()
    while alive(pids) and time.monotonic() - began < 30:
        time.sleep(0.05)
    out: dict[str, Any] = {"pids": pids, "alive_after_cancel": alive(pids),
                           "gone_seconds": round(time.monotonic() - began, 2)}
    try:
        job.result(30)
    except Exception as e:
        out["error"] = type(e).__name__
    return out


def bridge(spark: Any, work: Path, lines: list[str]) -> dict[str, Any]:
    """``examples/spark_pipeline.py`` (unchanged: its coordinator comes from ``$TIMELY_SPARK_COORDINATOR``)
    started by ``submit``; another Spark job finds the coordinator where it was published, writes
    two epochs with ``format("timely")``, reads the counts back and shuts the job down."""
    from pyspark.sql import functions as F

    job = submit(spark, PIPELINE, 2, publish=str(work / "coordinator"), log=lines.append)
    endpoint = published(str(work / "coordinator"), 60)
    assert endpoint == job.coordinator(10), (endpoint, job.coordinator(10))
    df = spark.range(0, ROWS, numPartitions=2).selectExpr(f"(id * 2654435761) % {KEYS} as key", "id as value")
    for e in range(2):
        (df.where(F.col("value") % 2 == e).write.format("timely").mode("append").option("endpoint", endpoint)
         .option("stream", "events").option("keyColumn", "key").option("timeout", "60").save())
    spark_bridge.close_stream(endpoint, "events")
    counts = (spark.read.format("timely").option("endpoint", endpoint).option("stream", "counts")
              .option("endingEpoch", 2).option("timeout", "60").load())
    got = {r["key"]: r["n"] for r in counts.groupBy("key").agg(F.sum("count").alias("n")).collect()}
    spark_bridge.shutdown(endpoint)
    return {"counts": got, "endpoint": endpoint, **finish(job, lines, None, 60)}


def session(master: str, workdir: str | None) -> Any:
    conf = {}
    if workdir:
        from spark_standalone import session_conf

        conf = session_conf(Path(workdir), executors=2, cores=2)
    conf["spark.stage.maxConsecutiveAttempts"] = "3"  # a job whose worker always dies gives up after 3 runs
    return local_session(master, "timely-barrier-test", conf=conf, python_path=str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--master", required=True)
    p.add_argument("--workdir")
    p.add_argument("--out", required=True)
    p.add_argument("--scenarios", required=True)
    p.add_argument("--error-job")
    p.add_argument("--dying-job")
    opts = p.parse_args(argv)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    spark = session(opts.master, opts.workdir)
    watchdog = threading.Timer(280, lambda: os._exit(3))  # never outlive the test's patience
    watchdog.daemon = True
    watchdog.start()
    try:
        for name in opts.scenarios.split(","):
            if name == "local":
                spark.stop()
                spark = session("local[3]", None)
                result = scenario("wordcount", spark, out / "local-work", None, None)
            else:
                try:
                    result = scenario(name, spark, out / "work", opts.error_job, opts.dying_job)
                except Exception:
                    result = {"crash": traceback.format_exc()}
            (out / f"{name}.json").write_text(json.dumps(result))
            print(f"scenario {name}: {result.get('seconds')} s", flush=True)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
