"""Metrics of a running job, cheap enough to stay on (README "Observing a job").

Every worker counts, per operator, the records in and out, its invocations and the seconds they
took (busy time; reported per second as Flink's ``busyTimeMsPerSecond``), and the bytes it received;
Megaphone's bins add records per bin and state entries per bin (:func:`add_source`). Counting is
per batch and per invocation, never per record.

With a configuration (:class:`MetricsConfig`, from the launcher's ``--metrics-port``,
``--dashboard`` or ``--autobalance`` through the environment variable :data:`ENV`), each worker
sends a snapshot every ``interval`` seconds to worker 0's :class:`Hub`, which serves them to the
Prometheus endpoint (:mod:`timely.metrics.prometheus`), the dashboard and Megaphone's AutoBalancer.
Without one, ``worker.metrics.snapshot()`` still reads the worker's own counters.
"""
from __future__ import annotations

import sys
from typing import Any

from .core import ENV, LagProbe, MetricsConfig, WorkerMetrics, add_source, sources
from .hub import Hub, Reporter

__all__ = ["ENV", "Hub", "LagProbe", "MetricsConfig", "Reporter", "WorkerMetrics", "add_source", "attach", "sources"]


def attach(worker: Any, config: MetricsConfig | None = None) -> WorkerMetrics:
    """The metrics of ``worker`` (its ``metrics`` attribute): counters always; with ``config``
    (default: from :data:`ENV`) the reporter, and on worker 0 the hub, the Prometheus endpoint and
    the dashboard (:mod:`timely.dashboard`).
    A port that cannot be served is reported on stderr and the job runs on."""
    metrics = WorkerMetrics(worker)
    config = config if config is not None else MetricsConfig.from_env()
    metrics.config = config
    if config is None:
        return metrics
    if worker.index == 0:
        try:
            metrics.hub = Hub(config.hub if worker.peers > 1 else None, worker.peers)
        except OSError as e:
            sys.stderr.write(f"timely.metrics: error: {e}; the job runs without metrics collection\n")
            return metrics
        if config.port is not None:
            from .prometheus import serve  # (prometheus-client: only where the endpoint is asked for)

            server = serve(metrics.hub, config.port, config.host)
            if server is not None:
                metrics.servers.append(server)
        if config.dashboard is not None:
            from ..dashboard import serve as serve_dashboard  # (flask: only where the dashboard is asked for)

            metrics.dashboard = serve_dashboard(metrics, config.dashboard, config.host)
            if metrics.dashboard is not None:
                metrics.servers.append(metrics.dashboard)
    if worker.index == 0 or config.hub is not None:
        metrics.reporter = Reporter(metrics.snapshot, config.interval, metrics.hub, config.hub)
    return metrics
