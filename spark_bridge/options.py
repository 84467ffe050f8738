"""The options of ``format("timely")`` (case-insensitive, each with its aliases), read the same way
in every Spark process (driver, executors, the driver's commit process)."""
from __future__ import annotations

from typing import Any

from timely.comm.secret import JobSecret, resolve

from .client import DEFAULT_TIMEOUT, Coordinator, seconds
from .errors import BridgeError


def opt(options: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` set in ``options`` (not empty), else ``default``."""
    for n in names:
        v = options.get(n.lower()) if hasattr(options, "get") else None
        if v is None and hasattr(options, "get"):
            v = options.get(n)
        if v is not None and v != "":
            return v
    return default


def required(options: Any, names: tuple[str, ...], missing: str) -> str:
    """The option ``names[0]`` (or an alias); a clear error saying ``missing`` when absent."""
    value = opt(options, *names)
    if not value:
        raise BridgeError(f"format('timely') needs the option '{names[0]}': {missing}")
    return value


def endpoint(options: Any) -> str:
    """The coordinator endpoint of the timely job (``endpoint``)."""
    return required(options, ("endpoint", "timely.coordinator", "coordinator"),
                     "the coordinator of the timely job, e.g. .option('endpoint', 'tcp://127.0.0.1:7447')")


def stream(options: Any) -> str:
    """The source (writes) or sink (reads) name (``stream``)."""
    return required(options, ("stream", "timely.stream", "path"),
                     "the name given to spark_bridge.source (writes) or spark_bridge.sink (reads)")


def timeout(options: Any) -> float:
    """Seconds to wait for the cluster (``timeout``, default 30): a positive number."""
    return seconds(opt(options, "timeout", "timely.timeout", default=DEFAULT_TIMEOUT), "timeout")


def integer(options: Any, name: str, minimum: int = 0) -> int | None:
    """The integer option ``name`` (``startingEpoch``, ``endingEpoch``, ``maxEpochsPerTrigger``), at
    least ``minimum``; None when unset. A :class:`BridgeError` naming the option and the value otherwise."""
    value = opt(options, name)
    if value is None:
        return None
    try:
        out = int(str(value).strip())
    except ValueError:
        out = None
    if out is None or out < minimum:
        raise BridgeError(f"option '{name}' must be an integer of at least {minimum}, not {str(value)!r}")
    return out


def secret(options: Any) -> JobSecret | None:
    """The job secret (``secret`` text, else ``secretFile``, else the environment), or None."""
    return resolve(opt(options, "secret", "timely.secret"), opt(options, "secretFile", "timely.secretFile"))


def coordinator(options: Any) -> Coordinator:
    """A client of the job's coordinator, configured by the options."""
    return Coordinator(endpoint(options), timeout(options), secret(options))
