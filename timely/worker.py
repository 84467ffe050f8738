"""The worker: one per OS process. Owns the allocator, builds dataflows, and steps them."""
from __future__ import annotations

import contextlib
import inspect
import time as _time
import uuid
from collections.abc import Callable, Iterator, Sequence, Set
from typing import TYPE_CHECKING, Any

from .collector import batch_gc
from .comm.allocator import Allocator, Puller, Pusher
from .dataflow.dataflow import Dataflow, check_progress_mode
from .dataflow.fuzz import Fuzzer
from .dataflow.input import InputHandle
from .dataflow.scope import Scope
from .errors import BuildError, ProgressMismatchError, TimelyError
from .metrics import WorkerMetrics, add_source, attach
from .watchdog import Watchdog

#: Longest park (seconds) of a worker with checkpoints: worker 0 checks for commits this often.
CHECKPOINT_POLL = 0.05

if TYPE_CHECKING:
    from .checkpoint.checkpointer import CheckpointConfig, Checkpointer
    from .comm.secret import JobSecret


class MainNotRunError(TimelyError, TypeError):
    """``main`` is (or returned) a coroutine or a generator: calling it did not run the job."""


#: What a ``main`` may be whose call runs none of its body, and what such a call returns.
_NOT_RUN_FUNCTIONS = ((inspect.iscoroutinefunction, "an async function (async def)"),
                      (inspect.isasyncgenfunction, "an async generator function"),
                      (inspect.isgeneratorfunction, "a generator function (it contains yield)"))
_NOT_RUN_RESULTS = ((inspect.iscoroutine, "a coroutine"), (inspect.isasyncgen, "an async generator"),
                    (inspect.isgenerator, "a generator"))


def _not_run(obj: Any, kinds: tuple[tuple[Callable[[Any], bool], str], ...]) -> str | None:
    """The first of ``kinds`` whose test ``obj`` passes, or None."""
    return next((kind for test, kind in kinds if test(obj)), None)


def check_main(main: Callable[..., Any]) -> None:
    """Raise :class:`MainNotRunError` (a :class:`TypeError`) if ``main`` is a function whose call
    would not run its body: an ``async def`` (a coroutine function), an async generator or a
    generator function (one that contains ``yield``). Timely calls ``main(worker)`` and takes what it returns as the result;
    such a call only creates a coroutine or generator, and the job would end without running."""
    kind = _not_run(main, _NOT_RUN_FUNCTIONS)
    if kind is None:
        return
    name = getattr(main, "__qualname__", "main")
    raise MainNotRunError(f"{'main' if name == 'main' else f'main ({name})'} is {kind}: calling it would not run "
                          "it, as timely neither awaits nor iterates main(worker); make it a plain function")


def check_result(result: Any) -> None:
    """Raise :class:`MainNotRunError` (closing ``result`` first) if ``result``, what
    ``main(worker)`` returned, is a coroutine or a generator, whose body never ran (see
    :func:`check_main`)."""
    kind = _not_run(result, _NOT_RUN_RESULTS)
    if kind is None:
        return
    close = getattr(result, "close", None)  # (an async generator has none, and needs none)
    if close is not None:
        close()  # (no "never awaited" warning)
    raise MainNotRunError(f"main(worker) returned {kind}, whose code never ran: timely neither awaits nor iterates "
                          "what main returns; make main a plain function that runs the job")


class Worker:
    """A timely worker: ``index`` of ``peers``, with the job's ``args``.

    Build dataflows with ``with worker.dataflow() as scope: ...``, then drive them with
    :meth:`step` / :meth:`step_while`. Every worker must build the same dataflows in the same order.
    ``secret`` is the job secret (:attr:`secret`). ``checkpoint`` configures checkpoints
    (:attr:`checkpoint`). ``progress`` is how progress batches travel between the workers:
    ``"direct"`` (the default: each worker sends its batches to every worker) or ``"relay"`` (each
    worker sends them to worker 0, which forwards them, several to a message: 2(w - 1) messages
    per round of flushes instead of w(w - 1), for one more hop); every worker must use the same.
    """

    def __init__(self, allocator: Allocator, args: Sequence[str] = (), fuzz: int | None = None,
                 watchdog: float | None = None, watchdog_warn: bool = False, *,
                 secret: JobSecret | None = None, job_id: str | None = None,
                 checkpoint: CheckpointConfig | None = None, progress: str = "direct") -> None:
        self.progress = check_progress_mode(progress)
        self.allocator = allocator
        self._secret = secret
        self._job_id = job_id or uuid.uuid4().hex
        self.index: int = allocator.index
        self.peers: int = allocator.peers
        self.args: list[str] = list(args)
        self._next_channel = 0
        self._dataflows: list[Dataflow] = []
        self._building: Dataflow | None = None
        self._open_inputs: list[InputHandle] = []
        self.fuzz = fuzz  # seed of the schedule fuzzer (timely.dataflow.fuzz); None: no fuzzing
        self._built = 0  # dataflows built so far (each fuzzes with its own generator)
        self._labels: set[str] = set()  # the metrics labels of the dataflows built (Dataflow.label)
        self._label_next: dict[str, int] = {}  # per dataflow name, the number its next repeat tries first
        self.watchdog: Watchdog | None = None
        self.checkpoint: Checkpointer | None = None
        try:
            # The checkpoint runtime (timely.checkpoint): participants register with it while building.
            if checkpoint is not None:
                from .checkpoint.checkpointer import Checkpointer  # (fsspec: only for jobs with checkpoints)

                self.checkpoint = Checkpointer.open(checkpoint, self.index, self.peers, self._job_id)
            # Metrics (timely.metrics): counters always; the reporter, hub and endpoints when configured.
            self.metrics: WorkerMetrics = attach(self)
            # The stuck-operator watchdog (timely.watchdog): started last, stopped by close().
            if watchdog is not None:
                self.watchdog = Watchdog(watchdog, self.index, watchdog_warn)
                self.watchdog.start()
        except BaseException:
            self.close()  # the threads, handlers and servers started so far
            raise

    #: Register a metrics source (an object with ``metrics_name`` and ``metrics()``) for every worker
    #: of this process: :func:`timely.metrics.add_source`, here for the libraries built on timely.
    add_metrics_source = staticmethod(add_source)

    @property
    def job_id(self) -> str:
        """What every worker of this run of the job shares and no other run does (a digest of the
        job token; a fresh random id for a single in-process worker). Servers of the job use it to
        refuse peers of another job. Read-only."""
        return self._job_id

    @property
    def secret(self) -> JobSecret | None:
        """The job secret (``--secret-file``, ``TIMELY_SECRET``, ``timely.execute(secret=...)``), or
        ``None`` without one. Servers the job opens itself (the Spark bridge, a control endpoint)
        use it to admit only the job's own clients: :meth:`JobSecret.serve
        <timely.comm.secret.JobSecret.serve>`. Read-only."""
        return self._secret

    # -- construction ------------------------------------------------------------------------
    def new_channel(self) -> int:
        """The next channel identifier (creation order, identical on every worker)."""
        ch = self._next_channel
        self._next_channel += 1
        return ch

    def register_input(self, handle: InputHandle) -> None:
        """Remember an input so that :meth:`finish` closes it if the job left it open."""
        self._open_inputs.append(handle)

    def allocate(self, channel: int) -> tuple[list[Pusher], Puller]:
        """Allocate ``channel`` on the allocator: ``(pushers by worker, puller)``."""
        return self.allocator.allocate(channel)

    @contextlib.contextmanager
    def dataflow(self, name: str | None = None) -> Iterator[Scope]:
        """Build a dataflow in the ``with`` block; it starts running when the block ends."""
        if self._building is not None:
            raise BuildError("dataflows cannot be nested; use scope.iterative() for nested scopes")
        fuzzer = None if self.fuzz is None else Fuzzer(self.fuzz, self.index, self._built)
        df = Dataflow(self, name or f"dataflow {self._built}", fuzzer)
        self._built += 1
        # The dataflow's name in metrics: its name, numbered when an earlier dataflow of this worker
        # had it (every worker builds the same dataflows in the same order, so all agree).
        label, n = df.name, self._label_next.get(df.name, 1)
        if n > 1:
            label = f"{df.name} #{n}"
        while label in self._labels:  # (numbers resume where the name's last repeat stopped)
            n += 1
            label = f"{df.name} #{n}"
        self._label_next[df.name] = n + 1
        self._labels.add(label)
        df.label = label
        self._building = df
        try:
            yield Scope(df)
            df.freeze()
            if self.checkpoint is not None:
                self.checkpoint.built(df.name, df.digest)  # refuses another job's checkpoint
        finally:
            self._building = None
        self._dataflows.append(df)

    # -- execution ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Do one round of work without waiting; True while some dataflow remains."""
        return self.step_or_park(0)

    def step_or_park(self, timeout: float | None) -> bool:
        """Do one round of work; if there was none, wait up to ``timeout`` seconds for messages."""
        alloc = self.allocator
        if self.checkpoint is not None:
            self.checkpoint.poll()  # background errors; worker 0's commits
            timeout = CHECKPOINT_POLL if timeout is None else min(timeout, CHECKPOINT_POLL)
        # Peers that finished before this step's receive: all they sent is in the pullers, and
        # the steps below read it (the progress channels completely).
        finished = frozenset(alloc.finished())  # a snapshot: release() below may receive more
        alloc.receive()
        metrics = self.metrics
        unread = metrics.before_take()
        events = alloc.events()  # the channels that received messages: only their pullers are read
        metrics.after_take(unread)  # the bytes received since the last step
        did = False
        for df in self._dataflows:
            did = df.step(events) or did
        alloc.release()
        if any(df.complete() for df in self._dataflows):
            done = [df for df in self._dataflows if df.complete()]
            with self.metrics.lock:  # (a report reads both lists)
                self.metrics.retire(done)  # their final counts
                self._dataflows = [df for df in self._dataflows if not df.complete()]
            for df in done:
                df.release()
            # A closed input needs no closing by finish(): holding it would keep its completed
            # dataflow (operators, their state) alive for as long as main runs.
            self._open_inputs = [h for h in self._open_inputs if not h.closed]
        if not did and not any(df.busy() for df in self._dataflows):
            # Idle: first the operators that asked to run on an idle worker (the next step runs
            # them), then, with nothing left, the park.
            if finished:
                self._check_built(finished)
            if any([df.wake_idle() for df in self._dataflows]) or timeout == 0 or \
                    timeout is None and not self._dataflows:
                return bool(self._dataflows)  # (with no dataflow, nothing could end an unbounded park)
            timers = [t for t in (df.next_timer() for df in self._dataflows) if t is not None]
            if timers:
                timeout = min(timers) if timeout is None else min(timeout, *timers)
            alloc.await_events(timeout)
        return bool(self._dataflows)

    def _check_built(self, finished: Set[int]) -> None:
        """Raise :class:`ProgressMismatchError` if a finished worker never built one of our dataflows
        (it would wait forever for that worker's share of the initial capabilities)."""
        for df in self._dataflows:
            missing = df.never_built_by(finished)
            if missing:
                raise ProgressMismatchError(
                    f"dataflow '{df.name}': worker {missing[0]} finished without building it, so it can never "
                    f"complete on worker {self.index}; every worker must build the same dataflows in the same order"
                )

    def step_while(self, condition: Callable[[], bool], timeout: float | None = None) -> None:
        """Step until ``condition()`` is false (parking when idle). ``timeout`` seconds: raise
        :class:`TimeoutError` instead of waiting longer."""
        deadline = None if timeout is None else _time.monotonic() + timeout
        while condition():
            self.step_or_park(0.05)
            if deadline is not None and _time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.index}: step_while condition still true after {timeout} s")

    def has_dataflows(self) -> bool:
        """True while some dataflow has not completed."""
        return bool(self._dataflows)

    def run(self, main: Callable[[Worker], Any]) -> Any:
        """Run ``main(self)`` under the workers' collector settings (:func:`timely.collector.batch_gc`),
        then close the inputs it left open and run the dataflows to completion; return its result.
        The worker is closed afterwards, also on failure. A ``main`` that is a coroutine or
        generator function, or that returns a coroutine or generator, raises
        :class:`MainNotRunError`, a :class:`TypeError` (:func:`check_main`, :func:`check_result`)."""
        try:
            check_main(main)
            with batch_gc():
                result = main(self)
                check_result(result)
                self.finish()
                if self.checkpoint is not None:
                    self.checkpoint.flush()
            return result
        finally:
            self.close()

    def close(self) -> None:
        """Release what the worker holds outside its dataflows (the watchdog's and the checkpoint
        writer's threads, the metrics reporter and servers); idempotent."""
        metrics = getattr(self, "metrics", None)  # (None: __init__ failed before attaching them)
        if metrics is not None:
            metrics.close()
        if self.checkpoint is not None:
            self.checkpoint.close()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def finish(self) -> None:
        """Close every input still open and step until all dataflows have completed."""
        for handle in self._open_inputs:
            handle.close()
        self._open_inputs.clear()
        while self._dataflows:
            self.step_or_park(0.05)
