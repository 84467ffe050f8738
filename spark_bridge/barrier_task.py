"""The executor side of :func:`spark_bridge.run`: one Spark barrier task runs one timely worker.

Task ``i`` of the barrier stage is worker ``i``. It picks a free tcp port on its own host (worker 0
a second one for the Spark bridge's coordinator), and the tasks exchange ``ip:port`` with
``BarrierTaskContext.allGather``: every task then holds the same endpoint list, in partition order.
The job token is derived from the driver's random nonce, the endpoints and the *run* (the least
task attempt id of the stage attempt, which every task of one attempt shares and no other attempt
has), so the workers of two attempts never talk to each other and their checkpoint parts never mix.

The timely worker runs as a child process of the task's Python worker, supervised by the same code
as under ``timely.launch`` (:func:`timely.launch.supervise`): it dies with the task's process
(``PR_SET_PDEATHSIG``), so no timely process outlives its Spark task, and a worker that is killed
is noticed at once. When every worker has ended, the tasks exchange their verdicts with a second
``allGather`` and decide alike:

* every worker succeeded: each task yields ``(index, its pickled result)``;
* the first failure is the job's own error (an exception in ``main`` or an operator, a
  ``CheckpointError``): a restart would repeat it, so each task yields its outcome and the driver
  raises it, as ``timely.execute`` does;
* a timeout: likewise final (the driver raises :class:`TimeoutError`);
* otherwise a worker *died* (killed by a signal, exited without a result, stayed stopped) and every
  other one lost it: every task raises :class:`StageRetry`, the stage fails, and Spark runs it
  again (``spark.stage.maxConsecutiveAttempts``, default 4): every worker starts afresh, from the
  latest checkpoint when the job has checkpoints.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from timely.launch import STOPPED_GRACE, JobFileError, Outcome, load_job, primary_failure, run_worker, supervise

from .barrier_link import send

#: Outcome statuses a restart of the stage can cure: the worker process itself died or was lost.
RETRYABLE = ("killed", "exited", "suspended", "stopped")


class StageRetry(RuntimeError):
    """Raised in every barrier task when a timely worker died: the stage fails and Spark retries it."""


@dataclass(frozen=True)
class BarrierSpec:
    """Everything a barrier task needs (picklable: Spark ships it to the executors)."""

    workers: int
    job_path: str  #: the job file's absolute path on the driver
    job_source: bytes  #: its contents (executors use the file itself when they see the same one)
    args: tuple[str, ...] = ()
    nonce: str = ""  #: random per submission: part of every run's job token
    link: str | None = None  #: the driver's event listener (``host:port``)
    link_key: str = ""
    checkpoint: str | None = None
    checkpoint_every: int = 10
    bridge: bool = True
    coordinator_port: int = 0  #: 0: a free port on worker 0's host, chosen at each run
    publish: str | None = None  #: where worker 0's task writes the coordinator endpoint
    max_message_bytes: int | None = None  #: the bridge endpoints' frame limit (None: the default)
    secret: str | None = None
    timeout: float | None = None
    stopped_grace: float = STOPPED_GRACE
    options: dict[str, Any] = field(default_factory=dict)  #: for the ZmqAllocator (startup and heartbeat timeouts)


def barrier_task(spec: BarrierSpec, _rows: Iterable[Any]) -> Iterator[tuple[int, bytes]]:
    """The body of one barrier task (``rdd.barrier().mapPartitions(partial(barrier_task, spec))``)."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    index = ctx.partitionId()
    host = _task_host(ctx.getTaskInfos()[index].address)
    ip = _address(host)
    mine = {"host": host, "ip": ip, "port": _free_port(ip), "task": ctx.taskAttemptId(),
            "coordinator": (spec.coordinator_port or _free_port(ip)) if index == 0 and spec.bridge else None}
    peers = [json.loads(m) for m in ctx.allGather(json.dumps(mine))]
    run = min(int(p["task"]) for p in peers)
    endpoints = [f"tcp://{_bracket(p['ip'])}:{p['port']}" for p in peers]
    token = hashlib.sha256(f"{spec.nonce}/{run}/{endpoints}".encode()).hexdigest()[:32]
    coordinator = f"tcp://{_bracket(peers[0]['ip'])}:{peers[0]['coordinator']}" if spec.bridge else None
    if index == 0:
        if coordinator and spec.publish:
            publish(spec.publish, coordinator)
        send(spec.link, spec.link_key, kind="run", run=run, coordinator=coordinator, hosts=[p["host"] for p in peers])
    config = None
    if spec.checkpoint:
        from timely.checkpoint import CheckpointConfig

        config = CheckpointConfig(spec.checkpoint, spec.checkpoint_every, attempt=run)
    with _job_file(spec) as path:
        entry = functools.partial(_worker, spec, path, endpoints, token, coordinator, ip, config, run)
        outcome: Outcome | None = None
        try:
            done = supervise(entry, [index], timeout=spec.timeout, stopped_grace=spec.stopped_grace)[0]
            verdict = {"index": index, "status": done.status, "secondary": done.secondary, "describe": done.describe()}
            outcome = done
        except TimeoutError:
            verdict = {"index": index, "status": "timeout", "secondary": False,
                       "describe": f"worker {index} still running after {spec.timeout:g} s"}
    verdicts = [json.loads(m) for m in ctx.allGather(json.dumps(verdict))]
    decision, message = decide(verdicts)
    if index == 0:
        send(spec.link, spec.link_key, kind="verdict", run=run, decision=decision, message=message)
    if decision == "retry":
        raise StageRetry(f"timely {message}: the barrier stage fails so that Spark runs every worker again")
    yield index, pickle.dumps(pack(outcome, verdict), protocol=pickle.HIGHEST_PROTOCOL)


def decide(verdicts: list[dict]) -> tuple[str, str]:
    """What every task of a run does, from every worker's verdict: ``("ok", "")``, ``("final",
    why)`` (the driver raises it) or ``("retry", why)`` (the stage fails; Spark retries it)."""
    timeouts = [v for v in verdicts if v["status"] == "timeout"]
    if timeouts:
        return "final", timeouts[0]["describe"]
    outcomes = [Outcome(int(v["index"]), str(v["status"]), secondary=bool(v["secondary"])) for v in verdicts]
    if not any(o.failed for o in outcomes):
        return "ok", ""
    first = primary_failure(outcomes)
    why = next(v["describe"] for v in verdicts if int(v["index"]) == first.index)
    if first.status in RETRYABLE or first.secondary:
        return "retry", why
    return "final", why


def pack(outcome: Outcome | None, verdict: dict) -> dict:
    """The task's answer to the driver: its worker's outcome as plain fields (the operator's
    exception pickled apart, as the driver may lack its class), or the timeout."""
    if outcome is None:
        return {"index": verdict["index"], "timeout": verdict["describe"]}
    fields = {k: getattr(outcome, k) for k in ("index", "status", "result", "traceback", "summary", "secondary",
                                              "exitcode", "signal", "operator")}
    cause = outcome.cause
    fields["cause"] = None
    if cause is not None:
        summary = f"{type(cause).__name__}: {cause}"
        try:
            fields["cause"] = (pickle.dumps(cause, protocol=pickle.HIGHEST_PROTOCOL), summary)
        except Exception:
            fields["cause"] = (None, summary)
    try:
        pickle.dumps(fields["result"], protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        fields.update(status="error", result=None, summary=f"the result of worker {outcome.index} cannot be pickled: {e!r}",
                      traceback=None)
    return fields


def _worker(spec: BarrierSpec, path: str, endpoints: list[str], token: str, coordinator: str | None, ip: str,
            config: Any, run: int, index: int, report: Callable[[Any], None]) -> None:
    """The timely worker process (a child of the task's Python worker): load the job, run ``main``."""
    from timely.comm.secret import resolve

    if coordinator:
        os.environ["TIMELY_SPARK_COORDINATOR"] = coordinator
    here = os.path.dirname(spec.job_path)
    if os.path.isdir(here) and here not in sys.path:
        sys.path.insert(0, here)  # the job's own modules, where the driver's directory is visible
    sys.argv = [path, *spec.args]
    module = load_job(path)
    job_main = getattr(module, "main", None)
    if not callable(job_main):
        raise JobFileError(f"{spec.job_path}: main is {type(job_main).__name__} {job_main!r:.60}, not a function")

    def main(worker: Any) -> Any:
        ck = worker.checkpoint
        send(spec.link, spec.link_key, kind="worker", run=run, index=worker.index, host=socket.gethostname(),
             pid=os.getpid(), resume=None if ck is None else ck.resume_epoch)
        if coordinator:
            from .server import serve

            # Data endpoints on this host, not on worker 0's (an IPv6 address is bracketed by serve).
            serve(worker, coordinator, host=ip, max_message_bytes=spec.max_message_bytes)
        return job_main(worker)

    run_worker(main, index, spec.workers, endpoints, token, list(spec.args), report, secret=resolve(spec.secret),
               checkpoint=config, **spec.options)


@contextlib.contextmanager
def _job_file(spec: BarrierSpec) -> Iterator[str]:
    """The job file on this host: the driver's own path when it holds the same contents here, else
    a copy in a temporary directory (removed afterwards)."""
    try:
        with open(spec.job_path, "rb") as f:
            if f.read() == spec.job_source:
                yield spec.job_path
                return
    except OSError:
        pass
    folder = tempfile.mkdtemp(prefix="timely-job-")
    try:
        path = os.path.join(folder, os.path.basename(spec.job_path))
        with open(path, "wb") as f:
            f.write(spec.job_source)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def publish(url: str, endpoint: str) -> None:
    """Write ``endpoint`` (one line) to ``url`` (a path or fsspec URL), atomically where the file
    system allows: a reader sees the old line or the new one."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, path = fsspec.core.url_to_fs(url)
    data = (endpoint + "\n").encode()
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    else:
        fs.pipe_file(path, data)  # one PUT on object stores


def _task_host(address: str) -> str:
    """The host of a barrier task's ``host:port`` address."""
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 or address.startswith("[") else address
    return host.strip("[]")


def _address(host: str) -> str:
    """``host``'s IP address (ZeroMQ binds addresses, not names)."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return host


def _bracket(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _free_port(ip: str) -> int:
    """A tcp port free on ``ip`` a moment ago (the worker binds it right after the exchange)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])
