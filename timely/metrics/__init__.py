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

import contextlib
import importlib
import sys
from typing import Any

from .core import ENV, LagProbe, MetricsConfig, WorkerMetrics, add_source, sources
from .hub import Hub, Reporter

__all__ = ["ENV", "Hub", "LagProbe", "MetricsConfig", "Reporter", "WorkerMetrics", "add_source", "attach", "sources"]


def attach(worker: Any, config: MetricsConfig | None = None) -> WorkerMetrics:
    """The metrics of ``worker`` (its ``metrics`` attribute): counters always; with ``config``
    (default: from :data:`ENV`) the reporter, and on worker 0 the hub, the Prometheus endpoint and
    the dashboard (:mod:`timely.dashboard`).
    A port that cannot be served, or an optional dependency that is not installed (``prometheus-client``,
    ``pip install timely-py[metrics]``; ``flask``, ``pip install timely-py[dashboard]``), is reported on
    stderr and the job runs on without that endpoint. Should anything else fail, what was started is
    closed before the error propagates (the caller never saw the metrics, so could not close them)."""
    metrics = WorkerMetrics(worker)
    config = config if config is not None else MetricsConfig.from_env()
    metrics.config = config
    if config is None:
        return metrics
    try:
        _start(metrics, worker, config)
    except BaseException:
        with contextlib.suppress(Exception):  # (the original error is the one to see)
            metrics.close()
        raise
    return metrics


def _start(metrics: WorkerMetrics, worker: Any, config: MetricsConfig) -> None:
    """Start what ``config`` asks for, recording each thing in ``metrics`` as soon as it runs (so
    that ``metrics.close()`` stops it)."""
    if worker.index == 0:
        if worker.peers > 1 and config.hub is None:
            sys.stderr.write(f"timely.metrics: warning: MetricsConfig has no hub address for {worker.peers} workers: "
                             "only worker 0's metrics are collected (give hub='ipc://...' or 'tcp://127.0.0.1:PORT')\n")
        try:
            metrics.hub = Hub(config.hub if worker.peers > 1 else None, worker.peers)
        except OSError as e:
            sys.stderr.write(f"timely.metrics: error: {e}; the job runs without metrics collection\n")
            return
        if config.port is not None:
            # (prometheus-client, flask: imported only where the endpoint or the dashboard is asked for)
            serve = _optional("timely.metrics", ".prometheus", "the Prometheus endpoint", "prometheus-client", "metrics")
            if serve is not None:
                server = serve(metrics.hub, config.port, config.host)
                if server is not None:
                    metrics.servers.append(server)
                    if config.port == 0:  # (a free port: nobody could find it otherwise)
                        sys.stderr.write(f"timely.metrics: the Prometheus endpoint listens on "
                                         f"http://{_url_host(config.host)}:{server.port}/metrics\n")
        if config.dashboard is not None:
            serve_dashboard = _optional("timely.dashboard", "..dashboard", "the dashboard", "Flask", "dashboard")
            if serve_dashboard is not None:
                metrics.dashboard = serve_dashboard(metrics, config.dashboard, config.host)
                if metrics.dashboard is not None:
                    metrics.servers.append(metrics.dashboard)
                    if config.dashboard == 0:  # (a free port: nobody could find it otherwise)
                        sys.stderr.write(f"timely.dashboard: serving on {metrics.dashboard.url}\n")
    if worker.index == 0 or config.hub is not None:
        metrics.reporter = Reporter(metrics.snapshot, config.interval, metrics.hub, config.hub)


def _url_host(host: str) -> str:
    """``host`` as the host part of a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _optional(log: str, module: str, what: str, package: str, extra: str) -> Any:
    """``module``'s ``serve`` (relative to this package), or ``None`` after one line on stderr when
    an optional dependency it needs (``package``, from the extra ``extra``) is not installed: the
    job then runs without ``what``."""
    try:
        return importlib.import_module(module, __package__).serve
    except ImportError as e:
        if not _third_party(e):
            raise
        sys.stderr.write(f"{log}: error: {what} needs {package} (pip install timely-py[{extra}]): {e}; "
                         f"the job runs without {what}\n")
        return None


def _third_party(error: ImportError) -> bool:
    """True when ``error`` is about a module outside timely (an optional dependency not installed,
    or installed incompletely), not a fault of timely's own modules."""
    name = error.name or ""
    return bool(name) and name != "timely" and not name.startswith("timely.")
