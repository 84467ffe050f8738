"""Timely jobs serving the Spark bridge, shared by the Spark tests: a one-worker job in a
background thread (:class:`ThreadJob`), and a launched multi-process cluster (:class:`LaunchedJob`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import spark_bridge
import timely


class ThreadJob:
    """A one-worker timely job in a background thread, serving the bridge on an auto-chosen port
    (under the schedule fuzzer seeded ``fuzz`` if given: see :mod:`timely.dataflow.fuzz`).
    ``secret``: the job's bridge secret, which ``build`` passes to the source/sink; this harness
    uses it for status and shutdown."""

    def __init__(self, build, fuzz: int | None = None, secret: str | None = None) -> None:
        self.build = build
        self.fuzz = fuzz
        self.secret = secret
        self.ready = threading.Event()
        self.endpoint = ""  # the coordinator, once the job serves it
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        def main(worker):
            with worker.dataflow() as scope:
                grab = self.build(scope, "tcp://127.0.0.1:0")
            self.endpoint = spark_bridge.endpoint(worker) or ""
            self.ready.set()
            worker.finish()
            return grab()

        try:
            self.result = timely.execute(main, workers=1, fuzz=self.fuzz)[0]
        except BaseException as e:
            self.error = e
        finally:
            self.ready.set()

    def __enter__(self) -> ThreadJob:
        self.thread.start()
        assert self.ready.wait(30), "timely job did not start"
        if self.error:
            raise self.error
        return self

    def stop(self):
        if self.thread.is_alive():
            try:
                spark_bridge.shutdown(self.endpoint, timeout=5, secret=self.secret)
            except spark_bridge.BridgeError:
                pass
            self.thread.join(30)
        assert not self.thread.is_alive(), "timely job did not finish after shutdown"
        if self.error:
            raise self.error
        return self.result

    def __exit__(self, *exc) -> None:
        if self.thread.is_alive():
            try:
                spark_bridge.shutdown(self.endpoint, timeout=5, secret=self.secret)
            except Exception:
                pass
            self.thread.join(30)

    def stats(self, stream="events"):
        return spark_bridge.status(self.endpoint, secret=self.secret)["stats"][stream]


ROOT = str(Path(__file__).resolve().parents[1])


class LaunchedJob:
    """``python -m timely.launch -w N examples/spark_pipeline.py ENDPOINT --capture DIR`` in its own
    process group (``endpoint`` default: an ipc socket in ``tmp_path``); shut down through the
    bridge and reaped on exit (killed if it does not stop)."""

    def __init__(self, tmp_path: Path, workers: int = 2, extra=(), endpoint: str | None = None) -> None:
        self.endpoint = endpoint or f"ipc://{tmp_path}/coordinator"
        self.capture = tmp_path / "capture"
        self.capture.mkdir(parents=True)
        self.log = tmp_path / "cluster.log"
        self.cmd = [sys.executable, "-m", "timely.launch", "-w", str(workers),
                    os.path.join(ROOT, "examples", "spark_pipeline.py"), self.endpoint,
                    "--capture", str(self.capture), *extra]
        self.proc: Any = None  # the launcher's Popen, once entered

    def __enter__(self) -> LaunchedJob:
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                info = spark_bridge.status(self.endpoint, timeout=1)
                if all(info["endpoints"]):
                    return self
            except spark_bridge.BridgeError:
                pass
            assert self.proc.poll() is None, f"cluster exited early:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, "cluster did not start"
            time.sleep(0.1)

    def stop(self) -> list[dict]:
        """Shut the job down, check it exited 0; every worker's capture file."""
        spark_bridge.shutdown(self.endpoint, timeout=10)
        rc = self.proc.wait(60)
        assert rc == 0, f"cluster exited with {rc}:\n{self.log.read_text()}"
        return [json.loads(p.read_text()) for p in sorted(self.capture.glob("worker-*.json"))]

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            try:
                spark_bridge.shutdown(self.endpoint, timeout=2)
                self.proc.wait(20)
            except (spark_bridge.BridgeError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()


def stop_jvm() -> None:
    """End the Spark JVM this process started and reap it (it would otherwise outlive the tests)."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if gateway is None or proc is None:
        return
    try:
        gateway.shutdown()
    finally:
        SparkContext._gateway = None
        SparkContext._jvm = None
        if proc.stdin:
            proc.stdin.close()  # the gateway server exits when its stdin closes
        try:
            proc.wait(30)
        except Exception:
            proc.kill()
            proc.wait()
