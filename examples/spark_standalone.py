"""The Spark pipeline on a Spark standalone cluster: ``python examples/spark_standalone.py [--master URL]``.

1. Without ``--master``: starts a standalone Spark master and 2 workers from the pyspark package's
   own ``spark-class`` (loopback only, small memory, work and log directories in a temporary
   directory), so that the executors are separate JVMs started by the workers;
2. starts a timely cluster (``python -m timely.launch -w N examples/spark_pipeline.py``) serving the
   bridge's coordinator on a free loopback port;
3. a Spark job on the standalone master pushes ``(key, value)`` rows into the source ``events`` in
   ``--epochs`` writes, routed to the worker owning each key; the cluster counts rows per key;
4. Spark reads the ``counts`` sink back; the total per key is checked against a plain Python count
   (and written as JSON to ``--out`` if given);
5. the timely cluster, the Spark session and (if started here) the standalone cluster are stopped.

Exit status 0 when the check passes. The executors run this interpreter with the repository on
their ``PYTHONPATH`` (``spark.executorEnv``), so they find ``spark_bridge``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from spark_demo import free_port, start_cluster, stop_cluster

ROOT = Path(__file__).resolve().parents[1]
#: The JVM option that marks every JVM of one cluster (master, workers, executors, driver):
#: ``-D<TAG>=<workdir>``, so that leftovers can be found by their command line.
TAG = "timely.standalone"


def java_missing() -> str | None:
    """Why Spark cannot start here (no ``java``), else ``None``."""
    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return None
    return "Spark needs Java 17+ (no java on PATH, no JAVA_HOME)"


def spark_class() -> Path:
    """The ``spark-class`` script of the installed pyspark package."""
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "spark-class"


def _stop_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``timeout`` seconds; reap ``proc``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


class StandaloneCluster:
    """A Spark standalone master and ``workers`` workers on 127.0.0.1, each worker offering
    ``cores`` cores and ``memory`` (e.g. ``"600m"``) for executors. Everything it writes (logs,
    work directories) goes under ``workdir``; its JVMs carry ``-D{TAG}=workdir``.

    Use as a context manager: entering starts the JVMs and waits until every worker registered;
    leaving stops them all (the workers end their executors), killing what does not stop.
    """

    def __init__(self, workdir: Path, workers: int = 2, cores: int = 1, memory: str = "600m") -> None:
        self.workdir = workdir
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.port, self.webui_port = _free_ports(2)
        #: The URL a SparkSession connects to.
        self.master_url = f"spark://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []

    @property
    def tag(self) -> str:
        """The JVM option every JVM of this cluster carries."""
        return f"-D{TAG}={self.workdir}"

    def session_conf(self) -> dict[str, str]:
        """:func:`session_conf` for this cluster."""
        return session_conf(self.workdir, self.workers, self.cores)

    def start(self, timeout: float = 60.0) -> None:
        """Start the master and the workers; return once every worker registered."""
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(self.workdir / "logs"),
               "SPARK_DAEMON_MEMORY": "256m", "SPARK_DAEMON_JAVA_OPTS": f"{self.tag} -XX:+UseSerialGC",
               "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false"}  # no fixed REST port 6066
        self._spawn("master", env, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", str(self.webui_port))
        for i in range(self.workers):
            work = self.workdir / f"worker-{i}"
            work.mkdir(parents=True, exist_ok=True)
            self._spawn(f"worker-{i}", {**env, "SPARK_WORKER_DIR": str(work)}, "org.apache.spark.deploy.worker.Worker",
                        "--host", "127.0.0.1", "--port", "0", "--webui-port", "0", "--cores", str(self.cores),
                        "--memory", self.memory, "--work-dir", str(work), self.master_url)
        deadline = time.monotonic() + timeout
        while self.alive_workers() < self.workers:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Spark daemon exited with {p.returncode}; see {self.workdir}/*.log")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.workers} Spark workers did not register within {timeout} s")
            time.sleep(0.3)

    def _spawn(self, name: str, env: dict[str, str], main_class: str, *args: str) -> None:
        with open(self.workdir / f"{name}.log", "w") as log:
            # spark-class execs java: the Popen is the JVM; its own group holds its executors too.
            self.procs.append(subprocess.Popen([str(spark_class()), main_class, *args], env=env, stdout=log,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True))

    def alive_workers(self) -> int:
        """Workers the master counts as alive (0 while its web UI does not answer)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.webui_port}/json/", timeout=2) as r:
                return int(json.load(r).get("aliveworkers", 0))
        except (OSError, ValueError):
            return 0

    def executor_dirs(self) -> list[Path]:
        """The directories of the executors the workers launched (``worker-i/app-*/<id>``)."""
        return sorted(p for p in self.workdir.glob("worker-*/app-*/*") if p.is_dir())

    def leftovers(self) -> list[int]:
        """Pids of live processes whose command line carries this cluster's tag."""
        tag = self.tag.encode()
        pids = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if entry.isdigit() and tag in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
        return pids

    def still_running(self) -> list[int]:
        """Pids of live processes whose command line names the work directory (``pgrep -f``, which
        also sees executors and drivers started with it), or :meth:`leftovers` without pgrep."""
        if shutil.which("pgrep") is None:
            return self.leftovers()
        found = subprocess.run(["pgrep", "-f", str(self.workdir)], capture_output=True, text=True, timeout=10)
        return [int(pid) for pid in found.stdout.split()]

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the workers (and so their executors), then the master; kill whatever is left."""
        for p in reversed(self.procs):
            _stop_group(p, timeout)
        deadline = time.monotonic() + timeout
        while self.leftovers() and time.monotonic() < deadline:  # orphaned executors exit on their own
            time.sleep(0.2)
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> StandaloneCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def session_conf(workdir: Path, executors: int = 2, cores: int = 1, python_path: Path = ROOT) -> dict[str, str]:
    """Spark settings for a session on a standalone cluster working in ``workdir``: ``executors``
    executors of ``cores`` cores, running this interpreter with ``python_path`` on their Python
    workers' path; the executors and the driver carry the cluster's tag."""
    tag = f"-D{TAG}={workdir}"
    return {
        "spark.executor.memory": "512m",
        "spark.executor.cores": str(cores),
        "spark.cores.max": str(cores * executors),
        "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
        "spark.executorEnv.PYTHONPATH": str(python_path),
        "spark.executor.extraJavaOptions": f"{tag} -XX:+UseSerialGC",
        "spark.driver.extraJavaOptions": f"{tag} -XX:+UseSerialGC -XX:TieredStopAtLevel=1",
    }


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def expected_counts(rows: int, keys: int) -> dict[int, int]:
    """Rows per key of the generated data, computed in plain Python."""
    return dict(Counter((i * 2654435761) % keys for i in range(rows)))


def run_pipeline(master: str, conf: dict[str, str], workers: int, rows: int, keys: int, epochs: int) -> dict[int, int]:
    """Feed a ``workers``-worker timely cluster from a Spark session on ``master``; return the
    counts per key read back from it (summed over the epochs)."""
    from pyspark.sql import functions as F

    import spark_bridge
    from spark_bridge.session import local_session

    coordinator = f"tcp://127.0.0.1:{free_port()}"
    proc = start_cluster(workers, coordinator, [])
    spark: Any = None
    try:
        spark = local_session(master, "timely-spark-standalone", conf=conf, python_path=str(ROOT))
        df = spark.range(0, rows, numPartitions=4).selectExpr(f"(id * 2654435761) % {keys} as key", "id as value")
        for e in range(epochs):
            (df.where(F.col("value") % epochs == e).write.format("timely").mode("append")
             .option("endpoint", coordinator).option("stream", "events").option("keyColumn", "key")
             .option("timeout", "60").save())
        spark_bridge.close_stream(coordinator, "events")
        counts = (spark.read.format("timely").option("endpoint", coordinator).option("stream", "counts")
                  .option("endingEpoch", epochs).option("timeout", "60").load())
        got = {r["key"]: r["n"] for r in counts.groupBy("key").agg(F.sum("count").alias("n")).collect()}
        spark_bridge.shutdown(coordinator)
        if stop_cluster(proc) != 0:
            raise RuntimeError(f"the timely cluster exited with {proc.returncode}")
        return got
    finally:
        if proc.poll() is None:  # after a failure: ask the cluster to end, kill it if it does not
            with contextlib.suppress(Exception):
                spark_bridge.shutdown(coordinator, timeout=2)
            stop_cluster(proc, 5)
        if spark is not None:
            spark.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--master", help="a running standalone master (spark://HOST:PORT); default: start one here")
    p.add_argument("--cluster-dir", help="with --master: the cluster's work directory (its JVMs' tag)")
    p.add_argument("--workers", type=int, default=2, help="timely workers (default 2)")
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--keys", type=int, default=500)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", help="write the counts read back as JSON {key: count} to this file")
    args = p.parse_args(argv)
    why = java_missing()
    if why:
        print(why, file=sys.stderr)
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spark-standalone-") as tmp:
        if args.master:
            conf = session_conf(Path(args.cluster_dir or tmp))
            got = run_pipeline(args.master, conf, args.workers, args.rows, args.keys, args.epochs)
        else:
            with StandaloneCluster(Path(tmp)) as cluster:
                got = run_pipeline(cluster.master_url, cluster.session_conf(), args.workers, args.rows, args.keys,
                                   args.epochs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({str(k): v for k, v in sorted(got.items())}, f)
    want = expected_counts(args.rows, args.keys)
    ok = got == want
    print(f"spark standalone -> timely ({args.workers} workers): {args.rows} rows in {args.epochs} epochs, "
          f"{time.monotonic() - start:.1f} s; check: {'OK' if ok else 'MISMATCH'}: {len(got)} keys, "
          f"{sum(got.values())} rows counted; plain count: {len(want)} keys, {sum(want.values())} rows")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
