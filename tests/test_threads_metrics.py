"""Threads of timely.metrics: attach() closes what it started when it fails, and reports a missing
optional dependency as it reports a port in use; the reporter's socket stays on the reporter's
thread; one malformed message neither ends the hub's thread nor breaks view()."""
from __future__ import annotations

import socket
import sys
import threading
import time
from types import SimpleNamespace

import msgpack
import pytest
import zmq

from timely import metrics as timely_metrics
from timely.metrics import MetricsConfig, attach
from timely.metrics import hub as hub_module
from timely.metrics.hub import Hub, Reporter


def fake_worker(index: int = 0, peers: int = 1) -> SimpleNamespace:
    return SimpleNamespace(index=index, peers=peers, allocator=None, _dataflows=[], checkpoint=None)


def accepts(port: int) -> bool:
    with socket.socket() as c:
        return c.connect_ex(("127.0.0.1", port)) == 0


def snap(worker: int = 1, mono: float = 1.0, **extra) -> dict:
    return {"worker": worker, "mono": mono, "operators": [["df", 0, "Input", 1, 2, 0.5, 3]],
            "received_bytes": 10, "backlog_bytes": 0, **extra}


# -- attach() -------------------------------------------------------------------------------------------

@pytest.mark.timeout(20)
def test_attach_closes_the_servers_it_started_when_a_later_step_fails(monkeypatch):
    """The Prometheus endpoint and the dashboard run when creating the reporter fails: attach() must
    close them itself (the worker never gets the metrics object, so cannot)."""
    from timely.metrics import prometheus

    started: list = []
    real_serve = prometheus.serve
    monkeypatch.setattr(prometheus, "serve", lambda *a, **k: started.append(real_serve(*a, **k)) or started[-1])

    def broken_reporter(*args, **kwargs):
        raise RuntimeError("no reporter")

    monkeypatch.setattr(timely_metrics, "Reporter", broken_reporter)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="no reporter"):
        attach(fake_worker(), MetricsConfig(port=0, dashboard=0, interval=0.05))
    (server,) = started
    assert server is not None and not accepts(server.port)
    deadline = time.monotonic() + 5
    while {t for t in threading.enumerate() if t.is_alive()} - before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not {t.name for t in threading.enumerate() if t.is_alive()} - {t.name for t in before}


@pytest.mark.timeout(20)
def test_a_missing_dashboard_dependency_is_reported_and_the_job_runs_on(monkeypatch, capfd):
    from timely.metrics import prometheus

    started: list = []
    real_serve = prometheus.serve
    monkeypatch.setattr(prometheus, "serve", lambda *a, **k: started.append(real_serve(*a, **k)) or started[-1])
    monkeypatch.setitem(sys.modules, "flask", None)  # as without `pip install timely-py[dashboard]`
    monkeypatch.delitem(sys.modules, "timely.dashboard", raising=False)
    m = attach(fake_worker(), MetricsConfig(port=0, dashboard=0, interval=0.05))
    try:
        assert m.dashboard is None and m.reporter is not None and m.hub is not None
        (server,) = started
        assert m.servers == [server] and accepts(server.port)  # the endpoint asked for beside it runs
    finally:
        m.close()
    assert not accepts(server.port)
    err = capfd.readouterr().err
    assert "timely.dashboard: error: the dashboard needs Flask (pip install timely-py[dashboard])" in err
    assert "the job runs without the dashboard" in err


@pytest.mark.timeout(20)
def test_a_missing_prometheus_client_is_reported_and_the_job_runs_on(monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as without `pip install timely-py[metrics]`
    monkeypatch.delitem(sys.modules, "timely.metrics.prometheus", raising=False)
    m = attach(fake_worker(), MetricsConfig(port=0, interval=0.05))
    try:
        assert m.servers == [] and m.reporter is not None and m.hub is not None
    finally:
        m.close()
    err = capfd.readouterr().err
    assert "timely.metrics: error: the Prometheus endpoint needs prometheus-client (pip install timely-py[metrics])" in err
    assert "the job runs without the Prometheus endpoint" in err


# -- Reporter.stop() ------------------------------------------------------------------------------------

@pytest.mark.timeout(20)
def test_stop_never_uses_the_socket_of_a_reporter_still_inside_a_snapshot(monkeypatch, tmp_path):
    """stop() gives up waiting while the reporter's thread is in a slow snapshot: it must neither
    report nor close the socket from the caller's thread; the reporter's thread does both once
    its snapshot returns."""
    monkeypatch.setattr(hub_module, "STOP_WAIT", 0.2, raising=False)
    errors: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(f"{a.thread.name}: {a.exc_value!r}"))
    address = f"ipc://{tmp_path}/hub"
    hub = Hub(address, 2)
    inside, release = threading.Event(), threading.Event()
    callers: list[str] = []

    def snapshot() -> dict:
        callers.append(threading.current_thread().name)
        if not inside.is_set():
            inside.set()
            release.wait(10)  # a slow snapshot (a slow source, a stats() call)
        return snap(mono=time.monotonic())

    r = Reporter(snapshot, 0.01, None, address)
    try:
        assert inside.wait(5)
        r.stop()  # gives up after STOP_WAIT
        assert r._thread.is_alive()
        assert r._sock is not None and not r._sock.closed  # the reporter's thread still owns it
        assert callers == ["timely-metrics-reporter"]  # no report from the caller's thread
        release.set()
        r._thread.join(5)
        assert not r._thread.is_alive() and r._sock.closed and r._ctx.closed
        assert set(callers) == {"timely-metrics-reporter"} and len(callers) == 2  # and its last report
        assert hub.wait(lambda latest: 1 in latest, 5)
        assert errors == []
    finally:
        release.set()
        hub.close()


@pytest.mark.timeout(20)
def test_stop_sends_a_last_report_and_closes_the_socket(tmp_path):
    address = f"ipc://{tmp_path}/hub"
    hub = Hub(address, 2)
    calls: list[str] = []

    def snapshot() -> dict:
        calls.append(threading.current_thread().name)
        return snap(mono=time.monotonic())

    r = Reporter(snapshot, 3600.0, None, address)  # no report before stop()
    try:
        r.stop()
        assert not r._thread.is_alive() and r._sock.closed and calls == ["timely-metrics-reporter"]
        assert hub.wait(lambda latest: 1 in latest, 5) and hub.received == 1
        r.stop()  # idempotent
    finally:
        hub.close()


# -- the hub --------------------------------------------------------------------------------------------

MALFORMED = [
    {"worker": 1, "mono": 1.0},  # no operators, no byte counts
    {"worker": 1, "mono": "x", "operators": [], "received_bytes": 0, "backlog_bytes": 0},
    {"worker": 1, "mono": float("nan"), "operators": [], "received_bytes": 0, "backlog_bytes": 0},
    {"worker": 1, "mono": 2.0, "operators": "rows", "received_bytes": 0, "backlog_bytes": 0},
    {"worker": 1, "mono": 2.0, "operators": [["df", 0, "Map"]], "received_bytes": 0, "backlog_bytes": 0},
    {"worker": 1, "mono": 2.0, "operators": [[["df"], 0, "Map", 1, 1, 0.0, 1]], "received_bytes": 0, "backlog_bytes": 0},
    {"worker": 1, "mono": 2.0, "operators": [["df", 0, "Map", "1", 1, 0.0, 1]], "received_bytes": 0, "backlog_bytes": 0},
    {"worker": 1, "mono": 2.0, "operators": [], "received_bytes": None, "backlog_bytes": 0},
    {"worker": 1, "mono": 2.0, "operators": [], "received_bytes": 0, "backlog_bytes": "0"},
    {"worker": True, "mono": 2.0, "operators": [], "received_bytes": 0, "backlog_bytes": 0},
    {"worker": 7, "mono": 2.0, "operators": [], "received_bytes": 0, "backlog_bytes": 0},  # no such worker
    {"worker": -1, "mono": 2.0, "operators": [], "received_bytes": 0, "backlog_bytes": 0},
    [1, 2, 3],
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_a_malformed_snapshot_is_rejected_and_view_still_works(bad):
    hub = Hub(None, 2)
    hub.put(snap(worker=0, mono=1.0))
    hub.put(bad)
    hub.put(snap(worker=0, mono=2.0))
    view = hub.view()
    assert view["heard"] == [0] and view["rated"] == [0] and len(view["operators"]) == 1
    assert hub.received == 2 and hub.rejected == 1


@pytest.mark.timeout(10)
def test_malformed_optional_entries_are_left_out_and_the_rest_kept():
    hub = Hub(None, 2)
    good_bins = {"kind": "bins", "records": [1, 2], "state": [0, 1], "owned": [0, 1], "counters": {"installs": 1}}
    hub.put(snap(worker=0, lags={"p": {"frontier": 3, "lag_s": 0.5}, "q": {"lag_s": "late"}, "r": 5},
                 sources={"Count": good_bins, "Bad": {"kind": "bins", "records": [1], "state": [1, 2]},
                          "Ctl": {"kind": "counters", "prefix": "x", "values": {"n": 1}},
                          "Odd": {"kind": "counters", "values": [1]}, "Err": {"error": "boom"}, "Not": 3},
                 checkpoint="lots"))
    # another worker with another number of bins for the same source: not added to the first's
    hub.put(snap(worker=1, sources={"Count": {"kind": "bins", "records": [1, 2, 3], "state": [0, 0, 0], "owned": [2]}}))
    view = hub.view()
    assert [(lag["probe"], lag["lag_s"]) for lag in view["lags"]] == [("p", 0.5)]
    assert set(view["bins"]) == {"Count"} and view["bins"]["Count"]["records"] == [1, 2]
    assert [c["source"] for c in view["counters"]] == ["Ctl"]
    assert view["workers"][0]["checkpoint"] is None
    assert hub.received == 2 and hub.rejected == 0


@pytest.mark.timeout(10)
def test_the_prometheus_collector_reads_a_hub_that_got_malformed_snapshots():
    from prometheus_client import CollectorRegistry, generate_latest

    from timely.metrics.prometheus import HubCollector

    hub = Hub(None, 2)
    for bad in MALFORMED:
        hub.put(bad)
    hub.put(snap(worker=1))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HubCollector(hub))
    assert b'timely_operator_records_in_total{dataflow="df",index="0",operator="Input",worker="1"} 1.0' in (
        generate_latest(registry))


@pytest.mark.timeout(20)
def test_malformed_messages_never_end_the_hubs_thread(tmp_path):
    address = f"ipc://{tmp_path}/hub"
    hub = Hub(address, 2)
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        for bad in MALFORMED:
            s.send(msgpack.packb(bad))
        s.send(b"\xc1 not msgpack")
        s.send(msgpack.packb({"worker": 1, "mono": 1.0, "operators": [], "received_bytes": 0, "backlog_bytes": 0,
                              "lags": [], "sources": "x"}))  # fine: its optional entries are dropped
        s.send(msgpack.packb(snap(worker=1, mono=5.0)))
        assert hub.wait(lambda latest: latest.get(1, {}).get("mono") == 5.0, 5)
        assert hub._thread is not None and hub._thread.is_alive()
        view = hub.view()
        assert view["heard"] == [1] and view["rated"] == [1]
        assert hub.received == 2 and hub.rejected == len(MALFORMED) + 1
    finally:
        s.close(0)
        ctx.term()
        hub.close()
