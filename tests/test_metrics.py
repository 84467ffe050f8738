"""Metrics (timely.metrics): the counts equal the true counts of a known job, the Prometheus
endpoint serves every worker's figures, and a port in use or a bad option is a clear error."""
from __future__ import annotations

import socket
import time
import urllib.request
from collections import Counter

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import megaphone
import timely
from timely import routing
from timely.launch import main as launch_main
from timely.metrics import ENV, MetricsConfig

N = 500  # records per worker


def records(w: int) -> list[tuple[int, int]]:
    return [(w * 10_000 + i, i % 7) for i in range(N)]


def exchange_counts(peers: int) -> Counter:
    """Per worker: the records the exchange by field 0 sends it (the sequential oracle)."""
    out: Counter = Counter()
    for w in range(peers):
        for part_w, part in enumerate(routing.partition(records(w), peers, 0)):
            out[part_w] += len(part)
    return out


def known_job(worker: timely.Worker):
    """Each worker sends N records through map -> exchange -> filter (odd values) -> probe; worker 0
    returns the hub's view once every worker's final counts have arrived, and the endpoint's text."""
    with worker.dataflow() as scope:
        inp = scope.new_input()
        probe = inp.stream.map(lambda r: r).exchange(0).filter(lambda r: r[1] % 2 == 1).probe()
    inp.send_batch(records(worker.index))
    inp.close()
    worker.step_while(lambda: not probe.done(), timeout=30)
    if worker.index != 0:
        return None
    hub = worker.metrics.hub
    total = N * worker.peers

    def final(latest: dict) -> bool:
        rows = [r for s in latest.values() for r in s["operators"] if r[2].startswith("Exchange")]
        return len(latest) == worker.peers and sum(r[3] for r in rows) == total

    assert hub.wait(final, 20), "the workers' final counts never reached the hub"
    port = worker.metrics.servers[0].port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return hub.view(), text


def test_metrics_equal_true_counts(tmp_path, monkeypatch):
    peers = 2
    monkeypatch.setenv(ENV, MetricsConfig(hub=f"ipc://{tmp_path}/hub", interval=0.05, port=0).to_env())
    view, text = timely.execute(known_job, workers=peers, timeout=60)[0]
    ex = exchange_counts(peers)
    odd = sum(1 for w in range(peers) for r in records(w) if r[1] % 2 == 1)
    ops = {(o["worker"], o["operator"].split("#")[0]): o for o in view["operators"]}
    for w in range(peers):
        assert ops[w, "Input"]["records_out"] == N
        assert ops[w, "Map"]["records_in"] == ops[w, "Map"]["records_out"] == N
        assert ops[w, "Exchange"]["records_in"] == ex[w]
        assert ops[w, "Map"]["activations"] >= 1 and ops[w, "Map"]["busy_seconds"] > 0
    assert sum(ops[w, "Filter"]["records_out"] for w in range(peers)) == odd
    assert sum(ops[w, "Probe"]["records_in"] for w in range(peers)) == odd
    workers = {w["worker"]: w for w in view["workers"]}
    assert all(workers[w]["received_bytes"] > 0 for w in range(peers))  # each got part of the exchange
    # The endpoint serves the same figures, labelled by worker and operator.
    samples = {(s.name, s.labels.get("worker"), s.labels.get("operator", "").split("#")[0]): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    for w in range(peers):
        assert samples["timely_operator_records_in_total", str(w), "Exchange"] == ex[w]
        assert samples["timely_operator_records_out_total", str(w), "Input"] == N
        assert samples["timely_worker_received_bytes_total", str(w), ""] == workers[w]["received_bytes"]
        assert ("timely_operator_busy_time_ms_per_second", str(w), "Map") in samples


def test_megaphone_counts_records_per_bin():
    """One worker: the per-bin counts of a state machine equal a bincount of the records' bins."""
    k = 4
    data = [(i % 37, 1) for i in range(1000)]

    def job(worker: timely.Worker):
        with worker.dataflow() as scope:
            inp = scope.new_input()
            control = megaphone.ControlInput(scope, k=k)
            m = megaphone.state_machine(inp.stream, control, 0, lambda key, v, s: ((s or 0) + v, ()), name="Count")
        inp.send_batch(data)
        inp.close()
        control.close()
        worker.step_while(lambda: not m.probe.done(), timeout=30)
        return worker.metrics.snapshot()["sources"]["Count"]

    src = timely.execute(job, workers=1)[0]
    expect = np.bincount(routing.bins_of(data, 0, k), minlength=1 << k).tolist()
    assert src["kind"] == "bins" and src["records"] == expect
    assert sum(src["state"]) == 37 and src["owned"] == list(range(1 << k))


@pytest.mark.parametrize("option, what, held", [
    ("port", "the Prometheus endpoint", lambda m: m.servers),
    ("dashboard", "the dashboard", lambda m: m.dashboard),
])
def test_port_in_use_is_reported_and_the_job_runs(monkeypatch, capfd, option, what, held):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv(ENV, MetricsConfig(**{option: port}, interval=0.05).to_env())

        def job(worker: timely.Worker):
            with worker.dataflow() as scope:
                inp = scope.new_input()
                seen: list = []
                probe = inp.stream.inspect(seen.append).probe()
            inp.send_batch(list(range(10)))
            inp.close()
            worker.step_while(lambda: not probe.done(), timeout=30)
            return sorted(seen), held(worker.metrics)

        seen, server = timely.execute(job, workers=1)[0]
    assert seen == list(range(10)) and not server
    err = capfd.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and f"runs without {what}" in err


@pytest.mark.parametrize("argv, message", [
    (["--metrics-port", "70000"], "--metrics-port must be a port number"),
    (["--metrics-interval", "0"], "--metrics-interval must be a positive"),
    (["--dashboard", "-1"], "--dashboard must be a port number"),
    (["--dashboard", "8080", "--hostfile", "hosts.txt"], "work on one host only"),
    (["--autobalance", "threshold=x"], "is not a number"),
    (["--autobalance", "threshold"], "is not knob=value"),
    (["--autobalance", "bogus=1"], "--autobalance: unknown knob(s) bogus (known: threshold"),
    (["--autobalance", "strategy=nope"], "--autobalance: strategy='nope' is not auto or one of"),
    (["--autobalance", "threshold=0.2,target=0.3"], "must be below threshold"),
    (["--autobalance", "threshold=0"], "threshold must be positive"),
    (["--autobalance", "interval=-1"], "--autobalance: interval must be a number of seconds, 0 or more, not -1.0"),
    (["--autobalance", "interval=nan"], "interval must be a number of seconds, 0 or more, not nan"),
])
def test_launcher_refuses_bad_options(tmp_path, capsys, argv, message):
    job = tmp_path / "job.py"
    job.write_text("def main(worker):\n    pass\n")
    assert launch_main([*argv, str(job)]) == 2
    assert message in capsys.readouterr().err


def test_a_bare_autobalance_before_the_job_file_takes_no_options(tmp_path, capfd):
    """``--autobalance job.py`` took the job file for the AutoBalancer's options."""
    job = tmp_path / "job.py"
    job.write_text("def main(worker):\n    print('ran', worker.args)\n")
    assert launch_main(["--autobalance", str(job), "x=1"]) == 0
    assert "ran ['x=1']" in capfd.readouterr().out


def migrating_job(worker: timely.Worker):
    """Two workers; worker 0 moves half of the bins and reports what the endpoint says afterwards."""
    with worker.dataflow() as scope:
        data = scope.new_input()
        control = megaphone.ControlInput(scope, k=3)
        m = megaphone.state_machine(data.stream, control, 0, lambda key, v, s: ((s or 0) + v, ()), name="Count")
    controller = megaphone.Controller(control, m.probe) if worker.index == 0 else None
    assert megaphone.autobalance.attach(controller, worker) is None  # no --autobalance: metrics only
    if controller is not None:
        controller.rebalance([1 - w for w in controller.current_table][:4] + list(controller.current_table)[4:])
    for e in range(40):
        data.send_batch([(k, 1) for k in range(20)])
        data.advance_to(e + 1)
        control.advance_to(e + 1)
        if controller is not None:
            controller.tick()
        worker.step_while(lambda: m.probe.less_than(e), timeout=30)
    data.close()
    control.close()
    while controller is not None and controller.busy:
        controller.tick()
        worker.step_or_park(0.01)
    worker.step_while(lambda: not m.probe.done(), timeout=30)
    installs = sum(1 for ev in m.events if ev["kind"] == "install")
    if controller is None:
        return installs, None
    steps = len(controller.events)
    hub = worker.metrics.hub

    def reported(latest: dict) -> bool:
        snap = latest.get(0, {}).get("sources", {})
        return (snap.get("controller", {}).get("values", {}).get("steps_completed") == steps
                and snap.get("Count", {}).get("counters", {}).get("installs") == installs)

    assert hub.wait(reported, 20), "worker 0's final figures never reached its hub"
    port = worker.metrics.servers[0].port
    return installs, (steps, urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def test_migration_figures_reach_the_endpoint(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, MetricsConfig(hub=f"ipc://{tmp_path}/hub", interval=0.05, port=0).to_env())
    (installs0, (steps, text)), _ = timely.execute(migrating_job, workers=2, timeout=60)
    samples = {(s.name, s.labels.get("worker")): s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples}
    assert steps >= 1 and samples["megaphone_controller_steps_completed", "0"] == steps
    assert samples["megaphone_controller_migrations", "0"] == 1
    assert installs0 >= 1 and samples["megaphone_migration_installs_total", "0"] == installs0


def test_dataflows_of_one_name_are_counted_apart_and_each_once():
    """Two dataflows named alike are two metrics dataflows (the second numbered), with their own
    counts; and a report taken while the worker retires a completed dataflow counts it once."""
    import threading

    from timely.metrics.core import WorkerMetrics

    snapshots: list[list] = []
    retire = WorkerMetrics.retire

    def retire_with_a_report_meanwhile(self, dataflows):
        retire(self, dataflows)
        reporter = threading.Thread(target=lambda: snapshots.append(self.operators()))
        reporter.start()
        reporter.join(0.2)  # a report while the worker is between its two lists (it waits for the lock)

    def main(worker):
        for n in (3, 5):
            with worker.dataflow("counts") as scope:
                inp = scope.new_input()
                inp.stream.map(lambda x: x).probe()
            inp.send_batch(list(range(n)))
            inp.close()
            worker.step_while(worker.has_dataflows, timeout=10)
        return worker.metrics.operators()

    WorkerMetrics.retire = retire_with_a_report_meanwhile
    try:
        (rows,) = timely.execute(main, workers=1)
    finally:
        WorkerMetrics.retire = retire
    maps = {r[0]: r[3] for r in rows if r[2].startswith("Map")}
    assert maps == {"counts": 3, "counts #2": 5}
    for snapshot in snapshots:
        keys = [(r[0], r[1]) for r in snapshot]
        assert len(keys) == len(set(keys)), snapshot


def test_a_bin_counter_keeps_one_series_across_a_migration():
    """``megaphone_bin_records_total`` is one series per bin whatever worker holds it, so it never
    vanishes or falls at a migration; the owner is the gauge ``megaphone_bin_owner``."""
    from prometheus_client import CollectorRegistry, generate_latest

    from timely.metrics.prometheus import HubCollector

    class Hub:  # the hub's view before and after bin 1 moved from worker 0 to worker 1
        views = [{"records": [5, 7], "owner": [0, 0]}, {"records": [5, 9], "owner": [0, 1]}]

        def view(self):
            agg = self.views.pop(0)
            bins = {"Count": {**agg, "records_per_s": [0.0, 0.0], "state": [1, 1], "workers": {}, "reports": {}}}
            return {"operators": [], "workers": [], "lags": [], "counters": [], "bins": bins}

    registry = CollectorRegistry(auto_describe=False)
    registry.register(HubCollector(Hub()))
    scrapes = []
    for _ in range(2):
        text = generate_latest(registry).decode()
        scrapes.append({(s.name, tuple(sorted(s.labels.items()))): s.value
                        for fam in text_string_to_metric_families(text) for s in fam.samples})
    series = [{k: v for k, v in scrape.items() if k[0] == "megaphone_bin_records_total"} for scrape in scrapes]
    assert set(series[0]) == set(series[1]) == {("megaphone_bin_records_total", (("bin", b), ("operator", "Count")))
                                                 for b in ("0", "1")}
    bin1 = ("megaphone_bin_records_total", (("bin", "1"), ("operator", "Count")))
    assert (series[0][bin1], series[1][bin1]) == (7, 9)
    owner1 = ("megaphone_bin_owner", (("bin", "1"), ("operator", "Count")))
    assert (scrapes[0][owner1], scrapes[1][owner1]) == (0, 1)


def test_a_worker_running_dataflow_after_dataflow_reports_a_bounded_snapshot(monkeypatch):
    """Past KEEP_RETIRED completed dataflows the oldest are summed into one row: the snapshot stays
    bounded, the totals stay the true ones (the sum of every dataflow's records), and the hub gives
    the folded row no rate although it grows between reports."""
    from timely.metrics import core
    from timely.metrics.hub import Hub

    monkeypatch.setattr(core, "KEEP_RETIRED", 4)
    sizes = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]

    def main(worker):
        hub, seen = Hub(None, 1), []
        for n in sizes:
            with worker.dataflow("batch") as scope:
                inp = scope.new_input()
                inp.stream.map(lambda x: x, name="Double").probe()
            inp.send_batch(list(range(n)))
            inp.close()
            worker.step_while(worker.has_dataflows, timeout=10)
            snap = worker.metrics.snapshot()
            hub.put(snap)
            seen.append((snap["operators"], hub.view()["operators"]))
            time.sleep(0.01)
        hub.close()
        return seen

    (seen,) = timely.execute(main, workers=1)
    for i, (rows, view) in enumerate(seen):
        done = sizes[:i + 1]
        maps = [r for r in rows if r[2].startswith("Double")]
        assert len(maps) == min(len(done), 4)  # the newest, one by one
        folded = [r for r in rows if r[1] == core.FOLDED_INDEX]
        assert len(folded) == (1 if len(done) > 4 else 0)
        # the true totals: every dataflow's Map and input saw its records once, folded or not
        assert sum(r[3] for r in rows) == 2 * sum(done)
        assert all(v["records_in_per_s"] == 0.0 for v in view if v["index"] == core.FOLDED_INDEX)
    assert len(seen[-1][0]) == 4 * 3 + 1  # (input, map, probe) per dataflow kept, and the folded row


def test_a_dataflow_built_between_two_reports_has_rates_from_zero():
    """Rows the previous report lacked are dataflows built since (labels are never reused): their
    counters started at 0, so all they did counts in the interval. They read 0 before, which made a
    worker running dataflows shorter than the interval look idle."""
    from timely.metrics.hub import Hub

    hub = Hub(None, 1)
    try:
        def snap(mono: float, rows: list) -> dict:
            return {"worker": 0, "time": mono, "mono": mono, "operators": rows, "received_bytes": 0,
                    "backlog_bytes": 0, "lags": {}, "sources": {}}

        # rows: [dataflow, index, operator, records_in, records_out, busy_seconds, activations]
        hub.put(snap(10.0, [["short-1", 0, "Map", 100, 100, 0.4, 3]]))
        hub.put(snap(11.0, [["short-1", 0, "Map", 100, 100, 0.4, 3], ["short-2", 0, "Map", 50, 50, 0.5, 2]]))
        view = hub.view()
        rates = {o["dataflow"]: (o["records_in_per_s"], o["busy_ms_per_s"]) for o in view["operators"]}
        assert rates == {"short-1": (0.0, 0.0), "short-2": (50.0, 500.0)}
        assert view["workers"][0]["busy_ms_per_s"] == 500.0
    finally:
        hub.close()


@pytest.mark.parametrize("interval", [0, -1.0, "1", float("nan"), True])
def test_a_metrics_interval_that_would_spin_or_stop_the_reporter_is_refused(interval):
    with pytest.raises(ValueError, match="metrics interval must be a positive number of seconds"):
        MetricsConfig(interval=interval)
