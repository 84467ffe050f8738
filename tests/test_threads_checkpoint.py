"""The checkpoint writer's thread and Checkpointer.close(): close drops what is still queued, finishes
only the write already begun, and leaves no thread running after it (nor blob callables called)."""
from __future__ import annotations

import os
import threading
import time

import pytest

from timely.checkpoint import checkpointer as checkpointer_module
from timely.checkpoint.checkpointer import JOB, MAX_QUEUED, Checkpointer
from timely.checkpoint.store import Store


def parts(path) -> int:
    return len([n for n in os.listdir(os.path.join(path, "parts")) if n.endswith(".part")])


def backlogged(tmp_path, monkeypatch):
    """A checkpointer whose writer is held inside its first part's write (until ``release``), with
    :data:`MAX_QUEUED` more parts queued; ``called`` lists the epochs whose blob callables ran."""
    ck = Checkpointer(Store(str(tmp_path), JOB, run="r"), 1, 0, 1)
    inside, release = threading.Event(), threading.Event()
    real = ck.store.write_part

    def write_part(epoch, *args, **kwargs):
        if epoch == 1:
            inside.set()
            release.wait(10)  # a slow store
        return real(epoch, *args, **kwargs)

    monkeypatch.setattr(ck.store, "write_part", write_part)
    called: list[int] = []
    p = ck.register("s")
    p.offer(1, {"k1": lambda: called.append(1) or b"x"})
    assert inside.wait(5)  # the writer took epoch 1: the queue holds the next ones
    for e in range(2, 2 + MAX_QUEUED):
        p.offer(e, {f"k{e}": lambda e=e: called.append(e) or b"x"})
    assert ck._queue.full()
    return ck, release, called


@pytest.mark.timeout(20)
def test_close_drops_the_queued_parts_and_finishes_the_write_begun(tmp_path, monkeypatch):
    ck, release, called = backlogged(tmp_path, monkeypatch)
    timer = threading.Timer(0.3, release.set)  # the write begun ends while close() waits for it
    timer.start()
    try:
        ck.close()
        assert not ck._thread.is_alive()
        assert called == [1] and parts(tmp_path) == 1  # the parts still queued were dropped
        time.sleep(0.1)
        assert called == [1] and parts(tmp_path) == 1
        assert ck._queue.unfinished_tasks == 0
    finally:
        timer.cancel()
        release.set()


@pytest.mark.timeout(20)
def test_after_a_close_that_gave_up_waiting_the_writer_runs_nothing_more_and_ends(tmp_path, monkeypatch):
    """The write begun outlasts close()'s wait (a full queue behind it): once it ends, the writer
    thread ends too, without writing the queued parts or calling their blob callables."""
    monkeypatch.setattr(checkpointer_module, "CLOSE_WAIT", 0.2, raising=False)
    ck, release, called = backlogged(tmp_path, monkeypatch)
    try:
        began = time.monotonic()
        ck.close()
        assert time.monotonic() - began < 3.0
        assert ck._thread.is_alive()  # still inside the write begun
    finally:
        release.set()
    ck._thread.join(5)
    assert not ck._thread.is_alive()
    assert called == [1] and parts(tmp_path) == 1
    ck.close()  # idempotent


@pytest.mark.timeout(20)
def test_flush_then_close_writes_everything(tmp_path, monkeypatch):
    """A job that ends well flushes first (Worker.run): every part offered is written."""
    ck, release, called = backlogged(tmp_path, monkeypatch)
    release.set()
    ck.flush()
    ck.close()
    assert not ck._thread.is_alive()
    assert called == list(range(1, 2 + MAX_QUEUED)) and parts(tmp_path) == 1 + MAX_QUEUED
    assert Store(str(tmp_path), JOB).latest().epoch == 1 + MAX_QUEUED
