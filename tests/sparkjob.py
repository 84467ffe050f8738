"""A one-worker timely job serving the Spark bridge from a background thread (shared by the
Spark tests)."""
from __future__ import annotations

import threading
from typing import Any

import spark_bridge
import timely


class ThreadJob:
    """A one-worker timely job in a background thread, serving the bridge on an auto-chosen port
    (under the schedule fuzzer seeded ``fuzz`` if given: see :mod:`timely.dataflow.fuzz`)."""

    def __init__(self, build, fuzz: int | None = None) -> None:
        self.build = build
        self.fuzz = fuzz
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
                spark_bridge.shutdown(self.endpoint, timeout=5)
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
                spark_bridge.shutdown(self.endpoint, timeout=5)
            except Exception:
                pass
            self.thread.join(30)

    def stats(self, stream="events"):
        return spark_bridge.status(self.endpoint)["stats"][stream]
