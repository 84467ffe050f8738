"""Run a timely job on the Spark cluster users already have: one barrier stage, one task per worker.

::

    import spark_bridge
    results = spark_bridge.run(spark, "job.py", workers=4, args=["--epochs", "100"])

    job = spark_bridge.submit(spark, "job.py", workers=4, checkpoint="s3://bucket/ck")  # returns at once
    endpoint = job.coordinator()            # the Spark bridge's coordinator: format("timely") feeds it
    results = job.result()

Spark's barrier execution mode starts all tasks of a stage together, tells each task where the
others run, and retries the whole stage when one task fails: exactly what a timely cluster needs to
form and to restart. Task ``i`` is worker ``i`` (:mod:`spark_bridge.barrier_task`); the driver
checks that the cluster can run ``workers`` tasks at once before it submits anything (a barrier
stage that cannot start would otherwise wait), and listens for the tasks' events
(:mod:`spark_bridge.barrier_link`). The command line form is ``python -m spark_bridge.launch``.
"""
from __future__ import annotations

import math
import os
import pickle
import re
import secrets
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from timely import TimelyError, WorkerError
from timely.launch import MAX_HEARTBEAT_TIMEOUT, Outcome, check_job, failure_error

from .barrier_link import DriverLink
from .barrier_task import BarrierSpec, barrier_task

__all__ = ["BarrierJob", "InsufficientSlots", "run", "submit", "task_slots", "published"]


class InsufficientSlots(TimelyError, RuntimeError):
    """The Spark cluster cannot run one task per timely worker at the same time (barrier mode needs it)."""


def run(spark: Any, job: str, workers: int, args: Sequence[str] = (), **options: Any) -> list[Any]:
    """Run the job file ``job`` (its ``main(worker)``, as under ``timely.launch``) on ``workers``
    timely workers, one Spark barrier task each; return each worker's result by index (results must
    be picklable). Raises :class:`timely.WorkerError` naming the worker whose error ended the job,
    :class:`TimeoutError` after ``timeout``, :class:`InsufficientSlots` when the cluster cannot run
    ``workers`` tasks at once. ``options`` are :func:`submit`'s."""
    return submit(spark, job, workers, args, **options).result()


def submit(spark: Any, job: str, workers: int, args: Sequence[str] = (), *, checkpoint: str | None = None,
           checkpoint_every: int = 10, bridge: bool = True, coordinator_port: int = 0, publish: str | None = None,
           max_message_bytes: int | None = None, secret: str | None = None, timeout: float | None = None,
           slot_wait: float = 30.0,
           startup_timeout: float = 30.0, heartbeat_timeout: float = 30.0,
           log: Callable[[str], object] | None = None) -> BarrierJob:
    """Start the job as one barrier stage of ``workers`` tasks and return its :class:`BarrierJob` at once.

    ``checkpoint`` (a directory every executor sees, or an fsspec URL) and ``checkpoint_every`` turn
    checkpoints on: when a worker dies, Spark retries the stage and every worker resumes from the
    latest checkpoint (without them it starts again from its inputs). ``bridge``: worker 0 serves
    the Spark bridge's coordinator on ``coordinator_port`` of its host (0: a free port, chosen at each
    run), ``$TIMELY_SPARK_COORDINATOR`` names it in every worker and each worker's data endpoints
    bind on its own host; the endpoint is written to ``publish`` (a path or fsspec URL) when given
    (what a previous submission wrote there is removed first, so that :func:`published` waits for
    this job's; ``publish`` needs the bridge), and :meth:`BarrierJob.coordinator` returns it.
    ``max_message_bytes``: the bridge endpoints' frame limit (see :func:`spark_bridge.serve`;
    the job's sources and sinks may repeat it, not change it). ``secret``: the job secret's text (default: the
    executors' ``$TIMELY_SECRET`` / ``$TIMELY_SECRET_FILE``). ``timeout`` bounds each run (seconds).
    ``slot_wait``: how long to wait for executors to register before deciding the cluster is too
    small. ``startup_timeout`` and ``heartbeat_timeout`` are the workers' (see ``timely.launch``).
    ``log`` gets one line per run and per failure (default: stderr).
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    # Every option the tasks use is checked here, on the driver: a bad one found in a task fails
    # every run Spark makes of the stage, and reaches the user as Spark's error, not this one.
    for name, seconds in (("startup_timeout", startup_timeout), ("heartbeat_timeout", heartbeat_timeout)):
        if not 0 < seconds < math.inf:
            raise ValueError(f"{name} must be a positive number of seconds, not {seconds!r}")
    if heartbeat_timeout > MAX_HEARTBEAT_TIMEOUT:  # (the workers' TCP_MAXRT: milliseconds in a C int)
        raise ValueError(f"heartbeat_timeout must be at most {MAX_HEARTBEAT_TIMEOUT} seconds, not {heartbeat_timeout!r}")
    if not 0 <= slot_wait < math.inf:
        raise ValueError(f"slot_wait must be a number of seconds, 0 or more, not {slot_wait!r}")
    if isinstance(coordinator_port, bool) or not isinstance(coordinator_port, int) or not 0 <= coordinator_port <= 65535:
        raise ValueError(f"coordinator_port must be a port number (0: a free one), not {coordinator_port!r}")
    if checkpoint is not None:
        from timely.checkpoint import CheckpointConfig

        CheckpointConfig(checkpoint, checkpoint_every)  # (ValueError naming a bad checkpoint_every)
    if publish is not None and not bridge:
        raise ValueError(f"publish={publish!r} needs bridge=True: a job submitted with bridge=False serves no "
                         f"coordinator endpoint to publish")
    if publish is not None:
        _check_publish(publish)
    if max_message_bytes is not None and (isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int)
                                          or max_message_bytes < 1):
        raise ValueError(f"max_message_bytes must be a positive number of bytes, not {max_message_bytes!r}")
    if max_message_bytes is not None and not bridge:
        raise ValueError("max_message_bytes configures the bridge: it needs bridge=True")
    check_job(job)
    with open(job, "rb") as f:
        source = f.read()
    sc = spark.sparkContext
    require_slots(sc, workers, slot_wait)
    key = secrets.token_hex(16)
    if publish is not None:
        _unpublish(publish)  # (only now: a submission that failed above leaves the previous job's endpoint)
    handle = BarrierJob(workers, checkpoint is not None, log or _stderr)
    handle._link = DriverLink(*_driver_addresses(sc), key, handle._on_event)
    spec = BarrierSpec(
        workers=workers, job_path=os.path.abspath(job), job_source=source, args=tuple(args), nonce=secrets.token_hex(16),
        link=handle._link.address, link_key=key, checkpoint=_absolute(checkpoint), checkpoint_every=checkpoint_every,
        bridge=bridge, coordinator_port=coordinator_port, publish=_absolute(publish), max_message_bytes=max_message_bytes,
        secret=secret, timeout=timeout,
        options={"startup_timeout": startup_timeout, "heartbeat_timeout": heartbeat_timeout,
                 "heartbeat_ivl": min(1.0, heartbeat_timeout / 4)})
    handle._start(sc, spec, os.path.basename(job))
    return handle


class BarrierJob:
    """A timely job running as a Spark barrier stage (see :func:`submit`)."""

    def __init__(self, workers: int, checkpoints: bool, log: Callable[[str], object]) -> None:
        self.workers = workers
        #: The Spark job group of the stage (``sc.cancelJobGroup(group)`` stops it, as :meth:`cancel` does).
        self.group = f"timely-{uuid.uuid4().hex[:12]}"
        self._checkpoints = checkpoints
        self._log = log
        self._link: DriverLink | None = None
        self._thread: threading.Thread | None = None
        self._rows: list | None = None
        self._error: BaseException | None = None
        self._runs: list[int] = []

    def _start(self, sc: Any, spec: BarrierSpec, name: str) -> None:
        from functools import partial

        from pyspark import InheritableThread

        def collect() -> None:
            try:
                sc.setJobGroup(self.group, f"timely job {name} ({spec.workers} workers)", interruptOnCancel=True)
                rdd = sc.parallelize(range(spec.workers), spec.workers).barrier().mapPartitions(partial(barrier_task, spec))
                # A shuffle after the barrier stage: Spark retries a failed barrier *map* stage, never a result stage.
                self._rows = rdd.partitionBy(1).collect()
            except BaseException as e:
                self._error = e

        self._thread = InheritableThread(target=collect, name=f"spark-bridge-{self.group}", daemon=True)
        self._thread.start()

    def _on_event(self, event: dict) -> None:
        kind = event.get("kind")
        if kind == "run" and event.get("run") not in self._runs:
            self._runs.append(event["run"])
            if len(self._runs) > 1:
                self._log(f"run {len(self._runs)} of the barrier stage started on {', '.join(event.get('hosts', []))}")
        elif kind == "worker" and event.get("index") == 0 and len(self._runs) > 1 and self._checkpoints:
            resume = event.get("resume")
            where = "the start (no checkpoint yet)" if not resume else f"the checkpoint of epoch {resume}"
            self._log(f"run {len(self._runs)}: every worker resumes from {where}")
        elif kind == "verdict" and event.get("decision") == "retry":
            how = "the latest checkpoint" if self._checkpoints else "its inputs (no checkpoints)"
            self._log(f"{event.get('message')}: the barrier stage failed; on Spark's retry every worker starts again "
                      f"from {how}")

    def runs(self) -> int:
        """How many runs (Spark stage attempts) have started so far."""
        return len(self._runs)

    def events(self) -> list[dict]:
        """The tasks' events so far (``kind``: ``run``, ``worker``, ``verdict``), oldest first."""
        return [] if self._link is None else self._link.snapshot()

    def coordinator(self, timeout: float = 120.0) -> str:
        """The Spark bridge's coordinator endpoint of the current run (waits up to ``timeout``
        seconds for the first run to start). After a restart, ask again: it may have moved."""
        assert self._link is not None
        try:
            event = self._link.wait_for(lambda e: e.get("kind") == "run", timeout, self.done)
        except TimeoutError:
            if self.done():
                self.result(0)
            raise TimeoutError(f"the timely job's barrier stage did not start within {timeout:g} s") from None
        if not event.get("coordinator"):
            raise ValueError("this job was submitted with bridge=False: it serves no coordinator")
        return str(event["coordinator"])

    def done(self) -> bool:
        """True once the stage has ended (successfully or not)."""
        return self._thread is not None and not self._thread.is_alive()

    def cancel(self) -> None:
        """Cancel the stage: Spark kills its tasks, and with them every timely worker."""
        from pyspark import SparkContext

        sc = SparkContext._active_spark_context
        if sc is not None:
            sc.cancelJobGroup(self.group)
        if self._thread is not None:
            self._thread.join(5.0)  # (the stage's end: its tasks' last events are in)
        if self._link is not None and self.done():
            self._link.close()  # the listener's socket and thread (result() closes it otherwise)

    def result(self, timeout: float | None = None) -> list[Any]:
        """Wait for the job (at most ``timeout`` seconds: then :class:`TimeoutError`, the job goes
        on) and return each worker's result by index, or raise its failure (see :func:`run`)."""
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the timely job is still running after {timeout:g} s")
        if self._link is not None:
            if self._error is not None and self._runs:  # the last run's verdict left before its tasks failed
                last = self._runs[-1]
                try:
                    self._link.wait_for(lambda e: e.get("kind") == "verdict" and e.get("run") == last, 2.0)
                except TimeoutError:
                    pass
            self._link.close()
        if self._error is not None:
            raise self._spark_failure(self._error)
        assert self._rows is not None
        answers = [pickle.loads(payload) for _, payload in sorted(self._rows)]
        timeouts = [a["timeout"] for a in answers if "timeout" in a]
        if timeouts:
            raise TimeoutError(f"{timeouts[0]}; every worker was stopped")
        outcomes = [_outcome(a) for a in answers]
        if any(o.failed for o in outcomes):
            raise failure_error(outcomes)
        return [o.result for o in outcomes]

    def _spark_failure(self, error: BaseException) -> BaseException:
        """The error to raise for a stage Spark gave up on: the last run's failing worker when the
        tasks told us, else Spark's own error."""
        # Only the last run's verdict tells why Spark gave up: an earlier run's worker may have
        # failed otherwise than the last run's tasks (which may have failed before any verdict).
        last = self._runs[-1] if self._runs else None
        verdicts = [e for e in self.events() if e.get("kind") == "verdict" and e.get("decision") == "retry"
                    and e.get("run") == last]
        if not verdicts:
            return error
        m = re.match(r"worker (\d+)", str(verdicts[-1].get("message", "")))
        err = WorkerError(int(m.group(1)) if m else -1,
                          f"{verdicts[-1]['message']}, in each of the {len(self._runs)} runs Spark made of the barrier "
                          f"stage (spark.stage.maxConsecutiveAttempts); Spark's error: {str(error).splitlines()[0]}")
        err.__cause__ = error
        return err


def _check_publish(url: str) -> None:
    """Raise ValueError unless the coordinator's endpoint can be written to ``url``: a known fsspec
    protocol, and for a local path a parent that is (or can become) a directory. (Checked on the
    driver; the task that writes it may run on another host, which this cannot see.)"""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ValueError, ImportError) as e:
        raise ValueError(f"publish: cannot write to {url!r}: {e}") from None
    if isinstance(fs, LocalFileSystem):
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise ValueError(f"publish: cannot write to {url!r}: {parent} is not a directory")


def _unpublish(url: str) -> None:
    """Remove the endpoint a previous submission published at ``url``, if any: :func:`published`
    must wait for this submission's, not return a stale one at once. ValueError if it cannot be."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    try:
        if fs.exists(path):
            fs.rm_file(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ValueError(f"publish: cannot remove the endpoint a previous job published at {url!r}: {e}") from None


def _outcome(answer: dict) -> Outcome:
    cause = answer.pop("cause", None)
    out = Outcome(**answer)
    if cause is not None:
        data, summary = cause
        try:
            out.cause = pickle.loads(data) if data is not None else RuntimeError(summary)
        except Exception:
            out.cause = RuntimeError(summary)
    return out


def _conf(sc: Any, key: str, default: str | None = None) -> str | None:
    return sc.getConf().get(key, default)


def task_slots(sc: Any) -> int:
    """How many tasks the cluster runs at once now (every registered executor's cores divided by
    ``spark.task.cpus``; in local mode, the master's thread count divided by it)."""
    jsc = sc._jsc.sc()
    try:
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # an API Spark keeps private: fall back on the default parallelism
        return int(sc.defaultParallelism) // int(_conf(sc, "spark.task.cpus", "1") or 1)


def _most_slots(sc: Any) -> int | None:
    """The most task slots the application can ever get, where its settings say (``None``: unknown)."""
    cpus = int(_conf(sc, "spark.task.cpus", "1") or 1)
    master = sc.master or ""
    if master.startswith("local"):
        return None  # known at once: task_slots() is exact
    cores = _conf(sc, "spark.executor.cores")
    instances = _conf(sc, "spark.executor.instances")
    if instances and cores:
        return int(instances) * (int(cores) // cpus)
    most = _conf(sc, "spark.cores.max")
    if most:
        return (int(most) // int(cores)) * (int(cores) // cpus) if cores else int(most) // cpus
    return None


def require_slots(sc: Any, workers: int, wait: float) -> None:
    """Return once the cluster can run ``workers`` tasks at once; raise :class:`InsufficientSlots`
    at once when its settings cap it below that, or after ``wait`` seconds of executors not
    registering enough cores."""
    if (_conf(sc, "spark.dynamicAllocation.enabled", "false") or "").lower() == "true":
        raise InsufficientSlots("spark_bridge.run needs spark.dynamicAllocation.enabled=false: Spark's barrier "
                                "execution mode does not support dynamic allocation")
    cpus = int(_conf(sc, "spark.task.cpus", "1") or 1)
    most = _most_slots(sc)
    deadline = time.monotonic() + wait
    while True:
        slots = task_slots(sc)
        if slots >= workers:
            return
        local = (sc.master or "").startswith("local")
        capped = most is not None and most < workers
        if local or capped or time.monotonic() >= deadline:
            if local:
                where, limit = f"{sc.master} runs {slots} tasks at once", slots
            elif capped:
                assert most is not None
                where, limit = (f"the application's settings (spark.cores.max, spark.executor.cores, "
                                f"spark.executor.instances) allow at most {most} task slots"), most
            else:
                where, limit = (f"the application's executors offer {slots} task slots after waiting {wait:g} s "
                                f"for executors to register"), slots
            raise InsufficientSlots(
                f"spark_bridge.run: {workers} timely workers need {workers} Spark tasks running at once (a barrier "
                f"stage starts all its tasks together, one per worker, each taking spark.task.cpus={cpus} cores), but "
                f"{where}: ask for at most {limit} workers, or give the application more cores")
        time.sleep(0.2)


def published(url: str, timeout: float = 120.0) -> str:
    """The coordinator endpoint a job submitted with ``publish=url`` wrote there (waits up to
    ``timeout`` seconds for it): how another Spark application finds the job's bridge."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = fs.cat_file(path).decode().strip()
            if text:
                return text
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no coordinator endpoint was published at {url} within {timeout:g} s")
        time.sleep(0.2)


def _driver_addresses(sc: Any) -> tuple[str, str]:
    """``(bind, advertise)``: where the driver's event listener listens and the host tasks reach it at."""
    host = _conf(sc, "spark.driver.host") or socket.gethostname()
    bind = _conf(sc, "spark.driver.bindAddress") or host
    try:
        bind = str(socket.getaddrinfo(bind, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        bind = "0.0.0.0"
    return bind, host


def _absolute(path: str | None) -> str | None:
    """A local path made absolute (executors work in other directories); URLs unchanged."""
    if path is None or "://" in path:
        return path
    return os.path.abspath(path)


def _stderr(line: str) -> None:
    sys.stderr.write(f"spark_bridge: {line}\n")
    sys.stderr.flush()
