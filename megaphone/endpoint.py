"""The control endpoint: rebalance a running job from outside, over ZeroMQ.

Both sides live here: :class:`ControlEndpoint` (in the job, next to its :class:`Controller`) and
:func:`request` / :func:`call` (used by ``python -m megaphone.rebalance``). Requests and replies are
msgpack maps, or JSON objects (a payload starting with ``{``); a reply uses the request's encoding.

* ``{"op": "table"}`` -> ``{"ok": true, "table": [...], "planned": [...], "nbins", "peers"}``
  (plus ``"routing_table"``, the operator's compiled table, if ``routing_table=`` was given);
* ``{"op": "status", "migration": id?, "since": n?, "limit": n?}`` -> ``{"ok": true, "busy",
  "migrations", "control_time", "steps", "queued", "queued_count", "in_flight", "completed",
  "completed_count", "done"}`` with per-step bins, times and durations (see :func:`status`);
* ``{"op": "rebalance", "strategy": "batched", "table": [...] | "balanced": true |
  "moves": [[bin, worker], ...] or {bin: worker}}`` -> ``{"ok": true, "migration": id,
  "steps": n, "moves": m, "strategy": s}`` (a bin moved to two different workers is refused).

An invalid request gets ``{"ok": false, "error": "..."}`` and changes nothing.

Everything that arrives is from outside the job, so nothing that arrives can end it: a message
larger than ``max_message_bytes`` is refused by ZeroMQ itself (``ZMQ_MAXMSGSIZE``: the
connection is dropped before the message is buffered whole), a message that is not one request
frame behind a routing envelope is dropped and logged (logger ``megaphone.endpoint``), and a
payload that does not decode, or decodes to no valid request, gets an error reply. With a job
secret (:class:`~timely.comm.secret.JobSecret`; by default the worker's, :attr:`Worker.secret
<timely.worker.Worker.secret>`) the endpoint is a CURVE server that admits only clients holding
the secret; :func:`request` and :func:`call` take it as ``secret``, by default from the environment
(``TIMELY_SECRET`` / ``TIMELY_SECRET_FILE``), as ``python -m megaphone.rebalance`` does.
"""
from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq

from timely.comm.secret import CURVE_OVERHEAD, JobSecret, resolve
from timely.errors import TimelyError

from .controller import Controller
from .plan import STRATEGIES
from .table import apply, balanced, move_updates, rebalance_kind, validate_move

#: Largest request (bytes) a control endpoint accepts by default.
MAX_REQUEST_BYTES = 1 << 20

_log = logging.getLogger(__name__)


class RequestError(TimelyError, ValueError):
    """A control-endpoint request was refused: malformed (raised in the job), or answered with an
    error (raised by :func:`call` in the client, with the job's message)."""


class EndpointError(TimelyError, OSError):
    """The control endpoint cannot be reached: its address cannot be bound, or it did not answer in
    time."""


def _decode(payload: bytes, is_json: bool) -> Any:
    return json.loads(payload) if is_json else msgpack.unpackb(payload, raw=False, strict_map_key=False)


def _encode(message: Any, is_json: bool) -> bytes:
    return json.dumps(message).encode() if is_json else msgpack.packb(message, use_bin_type=True)


def _int(x: Any, what: str) -> int:
    """``x`` as an integer (JSON object keys arrive as strings); raises :class:`RequestError` naming
    ``what`` and the value for anything else (``"--1"`` and ``"²"`` too, which look like digits but
    that ``int`` refuses: the request is refused, never answered with an internal error)."""
    if isinstance(x, str):
        try:
            return int(x)
        except ValueError:
            raise RequestError(f"{what} {x!r} is not an integer") from None
    if isinstance(x, bool) or not isinstance(x, int):
        raise RequestError(f"{what} {x!r} is not an integer")
    return x


def status(controller: Controller, migration: int | None = None, since: int = 0, limit: int = 1000) -> dict[str, Any]:
    """A msgpack/JSON-friendly summary of ``controller``'s steps, every one or one ``migration``'s.

    ``completed`` lists completed steps from the ``since``-th on (in completion order, which is
    issue order: one step is in flight at a time; at most ``limit``; ``completed_count`` has the
    number of them the controller's log holds, ``completed_total`` every step completed since the
    start), ``queued`` the first ``limit`` queued steps (``queued_count`` all of them); ``done`` is
    true once every step has completed or was abandoned (``abandoned_count``: never issued, the
    control input closed first). ``trimmed`` is true for a migration the bounded log no
    longer holds (:class:`~megaphone.controller.Controller`: it drops only finished ones).
    """
    evs = [e for e in controller.events if migration is None or e.migration == migration]
    done = [e for e in evs if e.state == "completed"]
    queued = [e for e in evs if e.state == "queued"]
    abandoned = sum(e.state == "abandoned" for e in evs)
    trimmed = (migration is not None and not evs and 0 <= migration < controller.migrations
               and migration not in controller.empty_migrations)
    return {
        "trimmed": trimmed,
        "completed_total": controller.steps_completed,
        "busy": controller.busy,
        "migrations": controller.migrations,
        "control_time": controller.control.time,
        "steps": len(evs),
        "queued": [e.as_dict() for e in queued[:limit]],
        "queued_count": len(queued),
        "in_flight": [e.as_dict() for e in evs if e.state == "in_flight"],
        "copying": [e.as_dict() for e in evs if e.state == "copying"],
        "completed": [e.as_dict() for e in done[since:since + limit]],
        "completed_count": len(done),
        "abandoned_count": abandoned,
        "done": len(done) + abandoned == len(evs),
    }


class ControlEndpoint:
    """Answers requests about, and rebalance requests for, a running job's :class:`Controller`.

    Binds a ZeroMQ ROUTER socket at ``endpoint`` (``tcp://127.0.0.1:*`` picks a free port; the bound
    address is :attr:`endpoint`; :class:`EndpointError` if it cannot be bound). It is polled without
    blocking from :meth:`Controller.tick`, so requests are answered between driver iterations and
    never stall the worker. The protocol is in the module documentation. A request larger than
    ``max_message_bytes`` drops its connection; ``secret`` (default: the job secret of the worker
    that built the controller's control input, if any) makes the endpoint a CURVE server for the
    holders of that secret only. :attr:`requests` counts the requests answered, :attr:`dropped`
    the messages dropped as malformed.
    """

    def __init__(self, controller: Controller, endpoint: str = "tcp://127.0.0.1:*",
                 routing_table: Callable[[], Sequence[int]] | None = None, max_requests: int = 16, *,
                 secret: JobSecret | None = None, max_message_bytes: int = MAX_REQUEST_BYTES) -> None:
        self.controller = controller
        self.routing_table = routing_table
        self.max_requests = max_requests
        self.requests = 0
        self.dropped = 0
        if secret is None:
            secret = getattr(controller.control, "secret", None)
        self._ctx = zmq.Context()
        self._guard = secret.guard(self._ctx) if secret is not None else None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # The limit counts a frame as it travels: under CURVE, with its encryption's overhead.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + (CURVE_OVERHEAD if secret is not None else 0))
        if secret is not None:
            secret.serve(self._sock)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise EndpointError(f"control endpoint cannot bind {endpoint}: {e}") from e
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        controller.add_poller(self.poll)

    def poll(self) -> int:
        """Answer the requests waiting now (at most ``max_requests``); never blocks."""
        if self._sock.closed:
            return 0
        n = 0
        while n < self.max_requests:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            # [identity, b"", request] from a REQ socket, [identity, request] from a DEALER: the
            # reply goes back behind the same envelope. Anything else is not a request.
            envelope, payload = frames[:-1], frames[-1]
            if len(envelope) > 2 or any(envelope[1:]):
                self._drop(f"{len(frames)} frames, not a routing envelope and one request")
                continue
            self.requests += 1
            is_json = payload[:1] == b"{"
            try:
                self._sock.send_multipart([*envelope, _encode(self.handle(payload), is_json)], zmq.NOBLOCK)
            except zmq.Again:
                pass  # the client went away: ROUTER drops the reply
        return n

    def _drop(self, why: str) -> None:
        """Count and log (the 1st, 2nd, 4th, 8th... time: a flood cannot flood the log) a dropped message."""
        self.dropped += 1
        if self.dropped & (self.dropped - 1) == 0:
            _log.warning("control endpoint %s dropped a malformed message (%s); %d dropped so far",
                         self.endpoint, why, self.dropped)

    def handle(self, payload: bytes) -> dict[str, Any]:
        """Decode and answer one request (never raises: errors become error replies)."""
        is_json = payload[:1] == b"{"
        try:
            try:
                req = _decode(payload, is_json)
            except Exception as e:
                raise RequestError(f"request is not valid {'JSON' if is_json else 'msgpack'}: {e}") from None
            return {"ok": True, **self.answer(req)}
        except TimelyError as e:  # a refused request (RequestError) or a bin or worker that does not exist
            return {"ok": False, "error": str(e)}
        except Exception as e:  # a bug must not stop the job: report it to the client
            return {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"}

    def answer(self, req: Any) -> dict[str, Any]:
        """The reply fields for a decoded request; raises :class:`RequestError` or
        :class:`~megaphone.table.TableError` if it is invalid."""
        if not isinstance(req, dict):
            raise RequestError(f"request must be a map with an 'op' field, not {type(req).__name__}")
        op = req.get("op")
        c = self.controller
        if op == "table":
            out: dict[str, Any] = {"table": list(c.current_table), "planned": list(c.planned_table),
                                   "nbins": c.nbins, "peers": c.peers}
            if self.routing_table is not None:
                out["routing_table"] = list(self.routing_table())
            return out
        if op == "status":
            mid = req.get("migration")
            if mid is not None:
                mid = _int(mid, "migration")
                if not 0 <= mid < c.migrations:
                    raise RequestError(f"migration {mid} does not exist ({c.migrations} so far)")
            since = _int(req.get("since", 0), "since")
            limit = _int(req.get("limit", 1000), "limit")
            if since < 0 or limit < 1:
                raise RequestError(f"'since' must be >= 0 and 'limit' >= 1 (got {since} and {limit})")
            return status(c, mid, since, limit)
        if op == "rebalance":
            return self._rebalance(req)
        raise RequestError(f"unknown op {op!r} (expected 'table', 'status' or 'rebalance')")

    def _rebalance(self, req: dict) -> dict[str, Any]:
        c = self.controller
        strategy = req.get("strategy", "batched")
        if strategy not in STRATEGIES:
            raise RequestError(f"unknown strategy {strategy!r} (expected one of {', '.join(STRATEGIES)})")
        kind = rebalance_kind(req, RequestError)
        if kind == "table":
            raw = req["table"]
            if not isinstance(raw, (list, tuple)):
                raise RequestError(f"'table' must be a list of workers, one per bin, not {type(raw).__name__}")
            target: Sequence[int] = [_int(w, "worker") for w in raw]
        elif kind == "balanced":
            target = balanced(c.nbins, c.peers)
        else:
            raw = req["moves"]
            pairs = list(raw.items()) if isinstance(raw, dict) else raw
            if not isinstance(pairs, (list, tuple)):
                raise RequestError("'moves' must be a list of [bin, worker] pairs or a {bin: worker} map")
            if not pairs:  # (it started an empty migration)
                raise RequestError("'moves' is empty: give at least one [bin, worker] pair")
            moves: dict[int, int] = {}
            for p in pairs:
                if not isinstance(p, (list, tuple)) or len(p) != 2:
                    raise RequestError(f"move {p!r} is not a [bin, worker] pair")
                b, w = _int(p[0], "bin"), _int(p[1], "worker")
                validate_move(b, w, c.nbins, c.peers)
                # One target per bin: of two different ones, neither is "the" move (the same move
                # twice is harmless, e.g. {"3": 1, 3: 1} in msgpack).
                if moves.get(b, w) != w:
                    raise RequestError(f"bin {b} is moved to both worker {moves[b]} and worker {w}")
                moves[b] = w
            target = apply(c.planned_table, move_updates(moves))
        mid = c.rebalance(target, strategy)  # validates the target: a bad one queues nothing
        steps = [e for e in c.events if e.migration == mid]
        return {"migration": mid, "steps": len(steps), "moves": sum(len(e.moves) for e in steps), "strategy": strategy}

    def close(self) -> None:
        """Close the socket (pending requests are dropped); idempotent."""
        if not self._sock.closed:
            self._sock.close(0)
        if self._guard is not None:
            self._guard.stop()  # (after the socket: the guard serves the context's servers)
            self._guard = None
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> ControlEndpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- the client side ----------------------------------------------------------------------------

def request(endpoint: str, req: dict[str, Any], timeout: float = 5.0,
            secret: str | JobSecret | None = None) -> dict[str, Any]:
    """Send one msgpack request to ``endpoint``; return the decoded reply.

    Uses a fresh REQ socket per request (closed without lingering), so a job that does not answer
    leaves nothing behind. ``secret`` (text or keys; default: ``TIMELY_SECRET`` /
    ``TIMELY_SECRET_FILE``, else none) is the job's: an endpoint with a secret answers only its
    holders. Raises :class:`EndpointError` if the endpoint cannot be reached or did not answer
    within ``timeout`` seconds (as when the secrets differ), :class:`ValueError` if ``timeout`` is
    not a positive, finite number.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        # zmq's poll waits forever for a negative timeout: a client must never hang on a typo
        raise ValueError(f"request to control endpoint {endpoint}: timeout must be a positive, finite "
                         f"number of seconds, not {timeout!r}")
    keys = resolve(secret)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if keys is not None:
            keys.connect(sock)
        sock.connect(endpoint)
        sock.send(_encode(req, False))
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise EndpointError(f"control endpoint {endpoint} did not answer within {timeout:g} s (a job that "
                                "reads the request later still acts on it)")
        return _decode(sock.recv(), False)
    except zmq.ZMQError as e:
        raise EndpointError(f"cannot talk to control endpoint {endpoint}: {e}") from e
    finally:
        sock.close(0)


def call(endpoint: str, req: dict[str, Any], timeout: float = 5.0,
         secret: str | JobSecret | None = None) -> dict[str, Any]:
    """:func:`request`, raising :class:`RequestError` (with the job's message) on an error reply."""
    reply = request(endpoint, req, timeout, secret)
    if not isinstance(reply, dict) or not reply.get("ok"):
        error = reply.get("error") if isinstance(reply, dict) else repr(reply)
        raise RequestError(f"{endpoint} rejected the request: {error}")
    return reply
