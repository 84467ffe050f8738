"""The errors of the Spark bridge. Every message names what it is about (endpoint, stream, column)."""
from __future__ import annotations

from timely import TimelyError


class BridgeError(TimelyError, RuntimeError):
    """Base class: something the bridge refused or could not do (``except timely.TimelyError``
    catches it too)."""


class BadEndpoint(BridgeError, ValueError):
    """An endpoint option that is not ``tcp://HOST:PORT`` or ``ipc://PATH``."""


class CoordinatorUnreachable(BridgeError, TimeoutError):
    """The coordinator (worker 0's endpoint) did not answer in time."""


class WorkerUnreachable(BridgeError, TimeoutError):
    """A worker's data endpoint did not accept or acknowledge data in time."""


class UnknownStream(BridgeError, KeyError):
    """No source / sink of that name exists in the running timely job."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SchemaMismatch(BridgeError, ValueError):
    """The DataFrame's schema differs from the one the timely job declared."""


class ClusterStopping(BridgeError):
    """The timely cluster is shutting down (or stopped) while a request was in flight."""


class CommitPending(BridgeError):
    """The coordinator decided a commit and waits for every worker to emit its epoch (the quick
    answer to a commit request that accepts it; the client keeps waiting)."""


class CommitUnconfirmed(BridgeError, TimeoutError):
    """A commit's outcome is unknown: the coordinator decided it but did not confirm within the
    timeout that every worker emitted its epoch (the write is applied unless the timely cluster
    fails first), or it received the request and did not answer (it may decide it later). Do not
    write the batch again without checking ``spark_bridge.status`` (that could duplicate its rows)."""


_KINDS = {
    "unknown_stream": UnknownStream,
    "schema": SchemaMismatch,
    "stopping": ClusterStopping,
    "pending": CommitPending,
}


def from_reply(reply: dict) -> BridgeError:
    """The exception for an error reply ``{"ok": False, "kind": ..., "error": ...}``."""
    return _KINDS.get(str(reply.get("kind")), BridgeError)(reply.get("error", "unknown error"))
