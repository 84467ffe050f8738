"""The Spark bridge beyond local mode: a Spark standalone cluster feeds a 2-worker timely cluster.

The fixture starts a standalone master and 2 workers from the pyspark package's own ``spark-class``
(``examples/spark_standalone.py``: loopback only, small memory, free ports, logs and work
directories in ``tmp_path``). The driver runs ``examples/spark_standalone.py --master URL`` in a
process of its own: one process holds one SparkContext, and this test session may already hold the
local-mode one of ``test_spark_e2e.py``. Its executors are separate JVMs started by the two workers;
they run this interpreter with the repository on their ``PYTHONPATH``. The counts read back from
timely must equal a plain Python count. Afterwards no process carrying ``tmp_path`` in its command
line is left (master, workers, executors, the driver's JVM), also when the test fails.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from procs import no_leftover_children

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from spark_standalone import StandaloneCluster, java_missing  # noqa: E402

_why = java_missing()
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")


@pytest.fixture
def cluster(tmp_path):
    """A running :class:`StandaloneCluster` (2 workers, 1 core each); stopped after the test, which
    fails if any of its JVMs (or an executor's) outlived the stop."""
    workdir = tmp_path / "spark"
    workdir.mkdir()
    with no_leftover_children():
        c = StandaloneCluster(workdir)
        try:
            c.start()
            yield c
        finally:
            c.stop()
            left = c.still_running()
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            assert not left, f"Spark processes left behind: {left}"


@pytest.mark.timeout(180)
def test_standalone_spark_feeds_two_timely_workers_and_reads_back(cluster, tmp_path, record_property):
    rows, keys, epochs = 40_000, 300, 2
    out, log = tmp_path / "counts.json", tmp_path / "driver.log"
    argv = [sys.executable, str(ROOT / "examples" / "spark_standalone.py"), "--master", cluster.master_url,
            "--cluster-dir", str(cluster.workdir), "--workers", "2", "--rows", str(rows), "--keys", str(keys),
            "--epochs", str(epochs), "--out", str(out)]
    start = time.monotonic()
    with open(log, "w") as f:
        driver = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = driver.wait(150)
    finally:
        if driver.poll() is None:  # Ctrl-C: its finally blocks stop its timely cluster and Spark session
            driver.send_signal(signal.SIGINT)
            try:
                driver.wait(20)
            except subprocess.TimeoutExpired:  # its group holds its JVM; the fixture reaps the rest
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait(10)
    record_property("driver_seconds", round(time.monotonic() - start, 1))
    assert rc == 0, log.read_text()[-5000:]
    got = {int(k): v for k, v in json.loads(out.read_text()).items()}
    assert got == Counter((i * 2654435761) % keys for i in range(rows))
    # The executors were separate JVMs, one started by each standalone worker.
    assert sorted(d.parent.parent.name for d in cluster.executor_dirs()) == ["worker-0", "worker-1"]
