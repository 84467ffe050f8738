"""A job across hosts that are really separate: one network namespace per host (``tests/netns.py``).

Each host runs ``python -m timely.launch --hostfile HOSTS --host-index H`` inside its namespace
(``ip netns exec``); the hosts reach each other only over veth links to a bridge, at 10.213.0.x
addresses that exist only inside the namespaces the test creates and deletes. Where the kernel has
the netem qdisc, every link gets 1 ms +- 0.5 ms of delay; where it has not, the test runs without
and records why (property ``netem``). Skipped, with the reason, where namespaces cannot be created
(not root, no ``ip``, no permission).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from netns import Network, remove_stale, unavailable
from procs import no_leftover_children

ROOT = str(Path(__file__).resolve().parents[1])
BASE_PORT = 2101  # free inside the fresh namespaces whatever the machine runs

_why = unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"network namespaces unavailable: {_why}")

# Keyed count: every worker generates its share of N records per epoch, the keys are exchanged to
# their owner, and each owner prints the per-epoch counts of the keys it owns.
COUNT_JOB = """
    import sys

    def main(worker):
        n, keys, epochs = map(int, worker.args)
        counts = []
        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = (inp.stream.count_by_key()
                     .inspect_batch(lambda t, batch: counts.extend((t, k, c) for k, c in batch)).probe())
        for epoch in range(epochs):
            inp.send_batch([(i * 2654435761 + epoch) % keys for i in range(worker.index, n, worker.peers)])
            inp.advance_to(epoch + 1)
            worker.step_while(lambda: probe.less_than(inp.time))
        inp.close()
        worker.finish()
        sys.stdout.write("".join(f"COUNT {t} {k} {c}\\n" for t, k, c in counts))
        sys.stdout.flush()
"""

# Runs until it fails: a small keyed count per epoch, "ready" once three epochs completed everywhere.
ENDLESS_JOB = """
    import sys, time

    def main(worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            probe = inp.stream.count_by_key().probe()
        epoch = 0
        while True:
            inp.send_batch([(i + epoch) % 97 for i in range(worker.index, 2000, worker.peers)])
            epoch += 1
            inp.advance_to(epoch)
            worker.step_while(lambda: probe.less_than(inp.time))
            if epoch == 3:
                sys.stdout.write(f"ready {worker.index}\\n")
                sys.stdout.flush()
            time.sleep(0.02)
"""


def _sequential(n: int, keys: int, epochs: int) -> Counter:
    """The keyed count of :data:`COUNT_JOB`, computed in one loop: ``{(epoch, key): count}``."""
    return Counter((epoch, (i * 2654435761 + epoch) % keys) for epoch in range(epochs) for i in range(n))


class Hosts:
    """A :class:`Network` of ``count`` hosts and the launcher each runs (stdout and stderr in files)."""

    def __init__(self, tmp_path: Path, count: int) -> None:
        self.tmp = tmp_path
        self.net = Network(count)
        self.hostfile = tmp_path / "hosts"
        self.hostfile.write_text("".join(f"{a}:{BASE_PORT}\n" for a in self.net.addresses))
        self.procs: list[subprocess.Popen] = []

    def launch(self, job: str, workers: int, args: list[str], timeout: float, options: tuple[str, ...] = ()) -> None:
        """Start ``timely.launch -w workers [options]`` of ``job`` on every host (host 0 last)."""
        path = self.tmp / "job.py"
        path.write_text(textwrap.dedent(job))
        for h in reversed(range(len(self.net.names))):
            argv = [sys.executable, "-m", "timely.launch", "-w", str(workers), "--hostfile", str(self.hostfile),
                    "--host-index", str(h), "--timeout", str(timeout), *options, str(path), *args]
            with open(self.out(h), "w") as out, open(self.err(h), "w") as err:
                self.procs.insert(0, subprocess.Popen(self.net.command(h, argv), cwd=ROOT, stdout=out, stderr=err,
                                                      start_new_session=True))

    def out(self, h: int) -> Path:
        return self.tmp / f"host{h}.out"

    def err(self, h: int) -> Path:
        return self.tmp / f"host{h}.err"

    def wait(self, timeout: float) -> list[int]:
        """Every launcher's exit status (waiting at most ``timeout`` seconds in all)."""
        deadline = time.monotonic() + timeout
        return [p.wait(max(0.1, deadline - time.monotonic())) for p in self.procs]

    def close(self) -> None:
        """Kill what still runs (each launcher's whole process group), reap it, delete the network."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        self.net.close()


@pytest.fixture
def hosts(tmp_path, request):
    """``hosts(count)`` -> :class:`Hosts`; everything is killed, reaped and deleted after the test."""
    made: list[Hosts] = []
    with no_leftover_children():
        remove_stale()

        def make(count: int) -> Hosts:
            made.append(Hosts(tmp_path, count))
            return made[-1]

        try:
            yield make
        finally:
            for h in made:
                h.close()


@pytest.mark.timeout(120)
def test_keyed_count_on_three_hosts_equals_sequential(hosts, record_property):
    n, keys, epochs = 30_000, 500, 3
    h = hosts(3)
    why = h.net.delay(1, 0.5)
    record_property("netem", why or "1ms 0.5ms on every link")
    if why:
        print(f"NOTE: running without link delay: {why}")
    start = time.monotonic()
    h.launch(COUNT_JOB, 2, [str(n), str(keys), str(epochs)], timeout=90)
    codes = h.wait(100)
    assert codes == [0, 0, 0], [h.err(i).read_text() for i in range(3)]
    record_property("job_seconds", round(time.monotonic() - start, 2))
    lines = [line.split() for i in range(3) for line in h.out(i).read_text().splitlines() if line.startswith("COUNT")]
    got = Counter({(int(t), int(k)): int(c) for _, t, k, c in lines})
    assert len(got) == len(lines), "a key was counted on more than one worker"
    assert got == _sequential(n, keys, epochs)
    # Every host did part of the work.
    assert all("COUNT" in h.out(i).read_text() for i in range(3))


@pytest.mark.timeout(150)
def test_cutting_a_link_ends_the_job_naming_the_lost_peer(hosts, record_property):
    # A cut link sends no FIN and no RST: the heartbeat timeout bounds how long it goes unnoticed.
    heartbeat = 3.0
    h = hosts(3)
    h.launch(ENDLESS_JOB, 1, [], timeout=120, options=("--heartbeat-timeout", str(heartbeat)))
    deadline = time.monotonic() + 60
    while not all("ready" in h.out(i).read_text() for i in range(3)):
        assert all(p.poll() is None for p in h.procs), [h.err(i).read_text() for i in range(3)]
        assert time.monotonic() < deadline, "the job did not start on every host"
        time.sleep(0.1)
    h.net.cut(2)
    cut = time.monotonic()
    codes = h.wait(heartbeat + 30)
    elapsed = time.monotonic() - cut
    record_property("seconds_to_fail", round(elapsed, 2))
    errs = [h.err(i).read_text() for i in range(3)]
    print("".join(f"host {i} (exit {c}):\n{e}" for i, (c, e) in enumerate(zip(codes, errs))))
    assert all(c != 0 for c in codes), (codes, errs)
    assert elapsed < heartbeat + 10, (elapsed, errs)
    # The hosts still connected to each other name worker 2 and its address; host 2 names a worker it lost.
    for i in (0, 1):
        assert "lost worker 2 (tcp://10.213.0.3:" in errs[i], errs[i]
    assert "lost worker 0" in errs[2] or "lost worker 1" in errs[2], errs[2]
