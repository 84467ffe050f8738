"""Threads on the Spark side (no Spark needed): the driver's barrier link counts a run before anyone
can see its event, and the client's ZeroMQ context is created once per process, whatever the
threads making their first call at once."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

import spark_bridge.client as client
from spark_bridge.barrier import BarrierJob
from spark_bridge.barrier_link import DriverLink, send


class Running:
    def is_alive(self) -> bool:
        return True


@pytest.mark.timeout(20)
def test_a_run_is_counted_before_coordinator_returns_its_endpoint():
    """BarrierJob counts runs in the link's on_event; the link must call it before wait_for (which
    coordinator() uses) or events() can see the event."""
    job = BarrierJob(2, False, lambda line: None)
    counted = job._on_event

    def slow_on_event(event: dict) -> None:
        time.sleep(0.3)  # the listener's thread is slow to count (a slow log line, GIL pressure)
        counted(event)

    link = job._link = DriverLink("127.0.0.1", "127.0.0.1", "k", slow_on_event)
    job._thread = Running()  # (the stage runs)
    try:
        assert send(link.address, "k", kind="run", run=1, coordinator="tcp://x:1", hosts=[])
        assert job.coordinator(5.0) == "tcp://x:1"
        assert job.runs() == 1
        assert send(link.address, "k", kind="verdict", run=1, decision="retry", message="worker 1 failed")
        link.wait_for(lambda e: e.get("kind") == "verdict", 5.0)
        assert send(link.address, "k", kind="run", run=2, coordinator="tcp://x:2", hosts=["h"])
        link.wait_for(lambda e: e.get("run") == 2, 5.0)
        assert job.runs() == 2  # an error now names run 2's verdict (none yet), not run 1's
        assert job._spark_failure(RuntimeError("spark")).__class__ is RuntimeError
    finally:
        link.close()


@pytest.mark.timeout(20)
def test_every_event_is_handed_to_on_event_once_and_kept_in_order():
    seen: list[tuple[int, bool]] = []
    link: DriverLink | None = None

    def on_event(event: dict) -> None:
        assert link is not None
        seen.append((event["n"], event in link.snapshot()))

    link = DriverLink("127.0.0.1", "127.0.0.1", "k", on_event)
    try:
        for n in range(5):
            assert send(link.address, "k", kind="worker", n=n)
        link.wait_for(lambda e: e.get("n") == 4, 5.0)
        assert seen == [(n, False) for n in range(5)]  # each handed over before it is visible
        assert [e["n"] for e in link.snapshot()] == list(range(5))
    finally:
        link.close()


@pytest.mark.timeout(20)
def test_threads_making_their_first_call_at_once_share_one_context(monkeypatch):
    """Without a lock around check-and-create, each thread that finds no context creates one (a slow
    creation makes it certain here), and the links cached meanwhile are dropped."""
    created: list[zmq.Context] = []
    real = zmq.Context

    def slow_context(*args, **kwargs):
        time.sleep(0.1)  # every thread checks before the first creation ends
        ctx = real(*args, **kwargs)
        created.append(ctx)
        return ctx

    monkeypatch.setattr(client, "_ctx", None)
    monkeypatch.setattr(client, "_ctx_pid", None)
    monkeypatch.setattr(client, "_links", {})
    monkeypatch.setattr(zmq, "Context", slow_context)
    start = threading.Barrier(4)
    got: list[zmq.Context] = []

    def first_call() -> None:
        start.wait()
        got.append(client.context())

    threads = [threading.Thread(target=first_call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        assert len(got) == 4 and len(created) == 1 and all(c is created[0] for c in got)
        links = client._links
        assert client.context() is created[0] and client._links is links  # (cached links are kept)
    finally:
        for ctx in created:
            ctx.term()
