"""Shared helpers for the dataflow tests: run a job on N workers, normalise results, size hypothesis.

Parametrize ids are ``w1``/``w2``/``w3``: ``pytest -k w1`` runs the single-worker cases only.
Property tests that fork workers use :func:`property_on_workers` (fewer examples with more workers).
Helpers used by a few modules only live in small modules beside this one: ``epoch_input.py`` and
``dataflows.py`` (random epochs, feeding and running them), ``oracles.py`` (per-epoch oracles),
``progress_reference.py`` and ``reachability*.py`` (``timely.progress`` oracles), ``megaphone_jobs.py``.
Runners take ``fuzz=SEED`` to run under the schedule fuzzer; the ``test_fuzz_*`` modules draw the
seed from :data:`FUZZ_SEEDS`.
"""
from __future__ import annotations

import functools
import inspect
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import timely
from timely.testing import bag
from timely.testing import normalize as norm

# A test run started in the background by a non-interactive shell inherits SIGINT and SIGQUIT
# ignored (POSIX), and so would every process the tests start: a job stopped with Ctrl-C by a test
# would never see it. Restore the defaults here, for this process and the processes it starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)

#: Seeds of the schedule fuzzer (``fuzz=SEED``) for hypothesis to draw: the fuzz tests' ``seed``.
FUZZ_SEEDS = st.integers(0, 2**32 - 1)

WORKER_COUNTS = [1, 2, 3]
WORKER_IDS = [f"w{n}" for n in WORKER_COUNTS]

#: ``@workers_param``: run the test once per worker count, with ids ``w1``/``w2``/``w3``.
workers_param = pytest.mark.parametrize("workers", WORKER_COUNTS, ids=WORKER_IDS)

__all__ = ["FUZZ_SEEDS", "WORKER_COUNTS", "WORKER_IDS", "bag", "examples", "launch_counting_job", "norm",
           "property_on_workers", "run", "workers_param"]

ROOT = Path(__file__).resolve().parent.parent
#: A job for the launcher: every worker counts 5 epochs of the keys 0..9 and prints its share.
COUNTING_JOB = (
    "import sys\n"
    "def main(worker):\n"
    "    with worker.dataflow() as scope:\n"
    "        inp = scope.new_input()\n"
    "        counts = inp.stream.count_by_key().capture()\n"
    "    for e in range(5):\n"
    "        inp.send_batch(list(range(10)))\n"
    "        inp.advance_to(e + 1)\n"
    "    inp.close()\n"
    "    worker.finish()\n"
    "    n = sum(n for _, recs in counts.batches for _, n in recs)\n"
    "    sys.stdout.write(f'worker {worker.index} counted {n}\\n')  # one write: the workers share the pipe\n"
)


def launch_counting_job(tmp_path: Path, workers: int, *options: str) -> list[int]:
    """Run :data:`COUNTING_JOB` with ``python -m timely.launch -w workers *options`` (60 s at most);
    assert that it succeeded and return what each worker counted."""
    job = tmp_path / "job.py"
    job.write_text(COUNTING_JOB)
    out = subprocess.run([sys.executable, "-m", "timely.launch", "-w", str(workers), *options, "--timeout", "60",
                          str(job)], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    return [int(line.split()[-1]) for line in out.stdout.splitlines() if "counted" in line]


def run(main, workers: int, fuzz: int | None = None, progress: str = "direct") -> list:
    """``timely.execute(main, workers=workers, fuzz=fuzz, progress=progress)``: one result per
    worker, by index (``fuzz=SEED``: under the schedule fuzzer, see :mod:`timely.dataflow.fuzz`)."""
    return timely.execute(main, workers=workers, fuzz=fuzz, progress=progress)


@pytest.fixture
def runner():
    """The :func:`run` helper as a fixture."""
    return run


def examples(workers: int, single: int = 20, multi: int = 4):
    """Hypothesis settings: ``single`` examples in-process, few when every example forks workers."""
    return settings(
        max_examples=single if workers == 1 else multi,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def property_on_workers(single: int = 20, multi: int = 4, **strategies):
    """Decorator: ``test(workers, ..., **drawn)`` runs once per worker count (``@workers_param``) as a
    hypothesis property drawing ``strategies``, with :func:`examples` ``(workers, single, multi)``.

    The test's other arguments (``@pytest.mark.parametrize`` values, fixtures) pass through; put
    parametrize marks above this decorator. The example count depends on ``workers``, which is only
    known when the test runs, so the settings are applied then.
    """

    def decorate(test):
        signature = inspect.signature(test)

        @functools.wraps(test)
        def run_property(**params):
            examples(params["workers"], single, multi)(given(**strategies)(test))(**params)

        # pytest sees the test's own arguments less the drawn ones (and not test's through __wrapped__).
        del run_property.__wrapped__
        run_property.__signature__ = signature.replace(
            parameters=[p for name, p in signature.parameters.items() if name not in strategies])
        return workers_param(run_property)

    return decorate


@pytest.fixture
def launched():
    """Launcher processes a test starts (append each ``subprocess.Popen``, started in a session
    of its own): after the test, those still running are killed with their process group; then
    every child (orphaned workers included) is killed and reaped, and the test fails if any was
    left."""
    from procs import no_leftover_children

    with no_leftover_children():
        started: list[subprocess.Popen] = []
        yield started
        for proc in started:  # launchers the test could not finish with
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
