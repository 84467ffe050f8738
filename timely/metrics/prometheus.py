"""The Prometheus endpoint of a job (``--metrics-port``): worker 0 serves every worker's figures,
read from its :class:`~timely.metrics.hub.Hub` at each scrape, labelled by ``worker`` (and
``dataflow``, ``operator``; ``bin`` for Megaphone's per-bin figures). Uses ``prometheus-client``.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .hub import Hub

_OP = ["worker", "dataflow", "operator", "index"]


class HubCollector(Collector):
    """A Prometheus collector over a :class:`Hub` (every family is read fresh at each scrape)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def collect(self) -> Iterator[Any]:
        """Yield every metric family (names in the README, section Observing a job)."""
        view = self.hub.view()
        fam: dict[str, Any] = {
            "in": CounterMetricFamily("timely_operator_records_in", "Records received by the operator", labels=_OP),
            "out": CounterMetricFamily("timely_operator_records_out", "Records sent by the operator", labels=_OP),
            "act": CounterMetricFamily("timely_operator_activations", "Invocations of the operator", labels=_OP),
            "busy": CounterMetricFamily("timely_operator_busy_seconds", "Seconds spent in the operator", labels=_OP),
            "bpms": GaugeMetricFamily("timely_operator_busy_time_ms_per_second",
                                      "Milliseconds per second spent in the operator (last interval)", labels=_OP),
            "inps": GaugeMetricFamily("timely_operator_records_in_per_second",
                                      "Records received per second (last interval)", labels=_OP),
            "outps": GaugeMetricFamily("timely_operator_records_out_per_second",
                                       "Records sent per second (last interval)", labels=_OP),
        }
        for r in view["operators"]:
            labels = [str(r["worker"]), r["dataflow"], r["operator"], str(r["index"])]
            fam["in"].add_metric(labels, r["records_in"])
            fam["out"].add_metric(labels, r["records_out"])
            fam["act"].add_metric(labels, r["activations"])
            fam["busy"].add_metric(labels, r["busy_seconds"])
            fam["bpms"].add_metric(labels, r["busy_ms_per_s"])
            fam["inps"].add_metric(labels, r["records_in_per_s"])
            fam["outps"].add_metric(labels, r["records_out_per_s"])
        yield from fam.values()
        yield from self._workers(view)
        yield from self._lags(view)
        yield from self._bins(view)
        yield from self._counters(view)

    def _counters(self, view: dict) -> Iterator[Any]:
        fams: dict[str, Any] = {}
        for c in view.get("counters", ()):
            for key, value in c["values"].items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                name = f"{c['prefix']}_{key}"
                fam = fams.get(name)
                if fam is None:
                    fam = fams[name] = GaugeMetricFamily(name, f"{c['source']}: {key.replace('_', ' ')}",
                                                         labels=["worker", "source"])
                fam.add_metric([str(c["worker"]), c["source"]], value)
        yield from fams.values()

    def _workers(self, view: dict) -> Iterator[Any]:
        recv = CounterMetricFamily("timely_worker_received_bytes", "Bytes received from other workers", labels=["worker"])
        backlog = GaugeMetricFamily("timely_worker_send_backlog_bytes", "Bytes waiting to be sent to other workers",
                                    labels=["worker"])
        busy = GaugeMetricFamily("timely_worker_busy_time_ms_per_second",
                                 "Milliseconds per second the worker spent in operators", labels=["worker"])
        ck_s = CounterMetricFamily("timely_checkpoint_write_seconds", "Seconds spent writing checkpoint parts",
                                   labels=["worker"])
        ck_parts = CounterMetricFamily("timely_checkpoint_parts", "Checkpoint parts written", labels=["worker"])
        ck_max = GaugeMetricFamily("timely_checkpoint_write_max_seconds", "Longest checkpoint part write",
                                   labels=["worker"])
        for w in view["workers"]:
            label = [str(w["worker"])]
            recv.add_metric(label, w["received_bytes"])
            backlog.add_metric(label, w["backlog_bytes"])
            busy.add_metric(label, w["busy_ms_per_s"])
            ck = w.get("checkpoint")
            if ck:
                ck_s.add_metric(label, ck.get("write_s", 0.0))
                ck_parts.add_metric(label, ck.get("parts", 0))
                ck_max.add_metric(label, ck.get("write_max_s", 0.0))
        yield from (recv, backlog, busy, ck_s, ck_parts, ck_max)

    def _lags(self, view: dict) -> Iterator[Any]:
        frontier = GaugeMetricFamily("timely_output_frontier", "Earliest incomplete time of a tracked output",
                                     labels=["worker", "probe"])
        lag = GaugeMetricFamily("timely_output_lag_seconds", "Wall-clock lag of a tracked output's frontier",
                                labels=["worker", "probe"])
        for p in view["lags"]:
            label = [str(p["worker"]), p["probe"]]
            if isinstance(p.get("frontier"), (int, float)):
                frontier.add_metric(label, p["frontier"])
            if p.get("lag_s") is not None:
                lag.add_metric(label, p["lag_s"])
        yield from (frontier, lag)

    def _bins(self, view: dict) -> Iterator[Any]:
        labels = ["operator", "bin", "worker"]  # worker: the bin's owner now
        rate = GaugeMetricFamily("megaphone_bin_records_per_second", "Records applied per bin per second", labels=labels)
        state = GaugeMetricFamily("megaphone_bin_state_entries", "State entries held per bin", labels=labels)
        # A counter keeps one series whatever worker owns the bin (invariant: a series of a counter
        # never decreases nor vanishes at a migration); the owner is a gauge of its own.
        total = CounterMetricFamily("megaphone_bin_records", "Records applied per bin, by every worker",
                                    labels=["operator", "bin"])
        owners = GaugeMetricFamily("megaphone_bin_owner", "The worker that holds the bin", labels=["operator", "bin"])
        counters: dict[str, Any] = {}
        for name, agg in view["bins"].items():
            for b, owner in enumerate(agg["owner"]):
                label = [name, str(b), str(owner)]
                rate.add_metric(label, agg["records_per_s"][b])
                state.add_metric(label, agg["state"][b])
                total.add_metric([name, str(b)], agg["records"][b])
                owners.add_metric([name, str(b)], owner)
            for w, cs in agg["workers"].items():
                for key, value in cs.items():
                    fam = counters.get(key)
                    if fam is None:
                        fam = counters[key] = CounterMetricFamily(f"megaphone_migration_{key}",
                                                                  f"Migration {key.replace('_', ' ')} on this worker",
                                                                  labels=["operator", "worker"])
                    fam.add_metric([name, str(w)], value)
        yield from (rate, total, state, owners, *counters.values())


class PrometheusServer:
    """The HTTP endpoint (``prometheus_client.start_http_server``) over ``hub`` at ``host:port``."""

    def __init__(self, hub: Hub, port: int, host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(HubCollector(hub))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"the Prometheus endpoint cannot listen on {host}:{port}: {e.strerror or e}") from e
        self.port: int = self._server.server_port

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


def serve(hub: Hub, port: int, host: str = "127.0.0.1") -> PrometheusServer | None:
    """Start the endpoint; on failure (the port in use) print a clear error and return None: the job
    runs on without it."""
    try:
        return PrometheusServer(hub, port, host)
    except OSError as e:
        sys.stderr.write(f"timely.metrics: error: {e}; the job runs without the Prometheus endpoint\n")
        return None
