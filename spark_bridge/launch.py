"""Run a job file on a Spark cluster: ``python -m spark_bridge.launch -w N [options] job.py [args...]``.

The command line form of :func:`spark_bridge.run`: it builds a SparkSession (``--master``,
``--conf KEY=VALUE``; under ``spark-submit`` both come from there), runs ``job.py``'s
``main(worker)`` on ``N`` timely workers as one Spark barrier stage (task ``i`` is worker ``i``) and
stops the session. Run it with ``spark-submit`` by passing this file's path::

    spark-submit --master yarn $(python -c 'import spark_bridge.launch as m; print(m.__file__)') -w 8 job.py

Exit status: 0 when every worker finished cleanly; 1 when a worker failed (its error is printed)
or ``--timeout`` expired; 2 for a usage error, a job file that cannot run, or a cluster that cannot
run ``N`` tasks at once (barrier mode needs one task slot per worker).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from timely import WorkerError
from timely.launch import JobFileError

#: Spark settings this command sets unless given: a barrier stage that cannot get its slots fails
#: after about 30 s instead of Spark's default of 40 checks 15 s apart.
BARRIER_CONF = {
    "spark.scheduler.barrier.maxConcurrentTasksCheck.interval": "2s",
    "spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures": "15",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spark_bridge.launch",
                                description="Run job.py's main(worker) on N timely workers, one Spark barrier task each.",
                                epilog="Arguments after the job file are passed to the job as worker.args.")
    p.add_argument("-w", "--workers", type=int, required=True, metavar="N", help="timely workers (Spark tasks)")
    p.add_argument("--master", help="the Spark master (default: spark-submit's, or Spark's own default)")
    p.add_argument("--name", default=None, help="the Spark application name (default: timely <job file>)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="a Spark setting (repeatable)")
    p.add_argument("--checkpoint", metavar="URL", help="take checkpoints there (a directory every executor sees, or "
                                                        "an fsspec URL); a retried stage resumes from the latest")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="N", help="epochs between checkpoints (10)")
    p.add_argument("--no-bridge", action="store_true", help="do not serve the Spark bridge's coordinator on worker 0")
    p.add_argument("--coordinator-port", type=int, default=0, metavar="P",
                   help="the bridge coordinator's port on worker 0's host (default: a free one)")
    p.add_argument("--publish", metavar="URL", help="write the bridge coordinator's endpoint there at each run")
    p.add_argument("--max-message-bytes", type=int, default=None, metavar="N",
                   help="the largest frame the bridge endpoints accept (default 256 MiB)")
    p.add_argument("--secret-file", metavar="FILE", help="the job secret (default: the executors' $TIMELY_SECRET)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="stop the job after S seconds")
    p.add_argument("--slot-wait", type=float, default=30.0, metavar="S",
                   help="seconds to wait for executors to offer N task slots (default 30)")
    p.add_argument("--startup-timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait for all workers to connect (default 30)")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0, metavar="S",
                   help="a peer silent for S seconds is lost (default 30)")
    p.add_argument("job", help="the job file: a Python file defining main(worker)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the job (worker.args)")
    return p


def _error(message: str) -> int:
    sys.stderr.write(f"spark_bridge.launch: error: {message}\n")
    return 2


def _session(opts: argparse.Namespace) -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(opts.name or f"timely {os.path.basename(opts.job)}")
    if opts.master:
        builder = builder.master(opts.master)
    given = {}
    for item in opts.conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--conf needs KEY=VALUE, not {item!r}")
        given[key.strip()] = value
    for key, value in {**BARRIER_CONF, **given}.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


#: The last line of a Python traceback inside Spark's error: ``ModuleNotFoundError: No module ...``.
_PYTHON_ERROR = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.*)$")


def stage_failure(e: BaseException) -> str:
    """One line for Spark's failure of the barrier stage: the Python exception raised in a task
    where Spark's error carries one (a Py4JJavaError's first line names only the Java call), with a
    hint when the executors could not import the project; else the error's first line."""
    text = str(e).strip()
    found = [m for m in map(_PYTHON_ERROR.match, text.splitlines()) if m is not None
             and not m.group(1).startswith(("py4j.", "org.apache.", "java."))]
    if not found:
        return f"{type(e).__name__}: {(text.splitlines() or [type(e).__name__])[0]}"
    name, message = found[-1].groups()
    line = f"{name}: {message} (raised in a Spark task; the log above has Spark's whole error)"
    if name.endswith(("ModuleNotFoundError", "ImportError")):
        line += ("; the executors' Python must have this project and its dependencies: set PYSPARK_PYTHON "
                 "(or spark.pyspark.python) to it")
    return line


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run the job on the Spark cluster and return the exit status."""

    from .barrier import InsufficientSlots, submit

    opts = _parser().parse_args(argv)
    if opts.workers < 1:
        return _error(f"-w must be at least 1, not {opts.workers}")
    if opts.checkpoint_every < 1:
        return _error(f"--checkpoint-every must be at least 1, not {opts.checkpoint_every}")
    secret = None
    if opts.secret_file:
        try:
            with open(opts.secret_file, encoding="utf-8") as f:
                secret = f.read().strip()
        except OSError as e:
            return _error(f"cannot read --secret-file {opts.secret_file}: {e.strerror}")
        if not secret:
            return _error(f"--secret-file {opts.secret_file} is empty")
    try:
        spark = _session(opts)
    except ValueError as e:
        return _error(str(e))
    job = None
    try:
        job = submit(spark, opts.job, opts.workers, opts.args, checkpoint=opts.checkpoint,
                     checkpoint_every=opts.checkpoint_every, bridge=not opts.no_bridge,
                     coordinator_port=opts.coordinator_port, publish=opts.publish,
                     max_message_bytes=opts.max_message_bytes, secret=secret, timeout=opts.timeout,
                     slot_wait=opts.slot_wait, startup_timeout=opts.startup_timeout,
                     heartbeat_timeout=opts.heartbeat_timeout,
                     log=lambda line: sys.stderr.write(f"spark_bridge.launch: {line}\n"))
        job.result()
        return 0
    except (JobFileError, InsufficientSlots, ValueError) as e:
        return _error(str(e))
    except WorkerError as e:
        sys.stderr.write(f"spark_bridge.launch: {e}\n")
        return worker_error_status(e)
    except TimeoutError as e:
        sys.stderr.write(f"spark_bridge.launch: timeout: {e}\n")
        return 1
    except Exception as e:  # Spark's own failure of the stage (its first line; the log has the rest)
        sys.stderr.write(f"spark_bridge.launch: the barrier stage failed: {stage_failure(e)}\n")
        return 1
    except KeyboardInterrupt:
        if job is not None:
            job.cancel()  # Spark kills the tasks, and the timely workers die with them
        sys.stderr.write("spark_bridge.launch: interrupted; the job was cancelled\n")
        return 130
    finally:
        spark.stop()


def worker_error_status(error: WorkerError) -> int:
    """The exit status of a run that failed with ``error``: 2 when its primary failure is the job
    file (a worker's import of it raised, or its ``main`` cannot run: ``JobFileError``), as
    ``timely.launch`` answers; else 1."""
    first = str(error).split("\n", 1)[0]
    return 2 if "JobFileError: " in first else 1


if __name__ == "__main__":
    sys.exit(main())
