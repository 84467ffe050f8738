"""Validation of every message that reaches the bridge from outside the job.

The bridge's coordinator and data endpoints accept connections from Spark processes, and from
anything else that can reach them. Before a message touches the bridge's state it passes one of
:func:`coordinator_request` or :func:`data_message`, which check its frame count, that its msgpack
frames decode to maps, and the type (and range) of every field the server reads. A message that
fails is a :class:`Refused`: the server logs it (rate-limited, see :class:`RefusalLog`), answers it
when it can tell whom to answer, and goes on. Size is limited before decoding, by ZeroMQ itself
(``ZMQ_MAXMSGSIZE``, see :data:`DEFAULT_MAX_MESSAGE_BYTES`).
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from . import protocol as P
from .protocol import Op, Request

#: Default limit of one frame sent to a bridge endpoint (``max_message_bytes`` of ``source``,
#: ``sink`` and ``serve``). ZeroMQ disconnects a peer that sends a larger frame before buffering it
#: whole; Spark writers learn the limit from the plan and split larger Arrow batches to fit.
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
#: Longest name, query id, token or request id accepted (characters or bytes).
MAX_NAME = 4096

Check = Callable[[Any], bool]


class Refused(ValueError):
    """A message from outside the job that is malformed: it is refused and logged, never applied."""


def _text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_NAME


def _nat(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62


def _flag(v: Any) -> bool:
    return isinstance(v, bool)


def _seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf


def _optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _list(item: Check) -> Check:
    return lambda v: isinstance(v, list) and all(item(x) for x in v)


def _pairs(first: Check, second: Check) -> Check:
    return lambda v: isinstance(v, list) and all(
        isinstance(p, list) and len(p) == 2 and first(p[0]) and second(p[1]) for p in v)


# [[token, [[worker, rows], ...]], ...]: the winning attempts of a commit (or those of an abort)
_tokens = _pairs(_text, _pairs(_nat, _nat))

_COORDINATOR: dict[str, dict[str, Check]] = {
    Request.HELLO: {"worker": _nat, "endpoint": _text, "generation": _text, "job": _optional(_text)},
    Request.PLAN: {"stream": _text, "kind": _text, "schema": _optional(_pairs(_text, _text)), "key": _optional(_text)},
    Request.COMMIT: {"stream": _text, "query": _text, "batch": _nat, "tokens": _tokens, "final": _optional(_flag),
                     "progress": _optional(_flag), "generations": _optional(_list(_text))},
    Request.ABORT: {"stream": _text, "query": _text, "batch": _nat, "tokens": _optional(_tokens),
                    "final": _optional(_flag)},
    Request.EXPIRE: {"stream": _text, "query": _text, "batch": _nat, "tokens": _list(_text)},
    Request.CLOSE: {"stream": _text},
    Request.SHUTDOWN: {},
    Request.STATUS: {},
}

_SINK: dict[str, Check] = {"sink": _text}
# op -> (frames after the op, the fields of the msgpack map its third frame is; DATA has none)
_DATA: dict[Op, tuple[int, dict[str, Check]]] = {
    Op.BEGIN: (3, {"stream": _text, "query": _text, "batch": _nat, "partition": _nat, "attempt": _nat,
                   "generation": _optional(_text), "timeout": _optional(_seconds)}),
    Op.DATA: (3, {}),
    Op.END: (2, {"rows": _nat, "batches": _nat}),
    Op.STATUS: (2, _SINK),
    Op.READ: (2, {**_SINK, "start": _nat, "end": _nat}),
    Op.RELEASE: (2, {**_SINK, "upto": _nat}),
    Op.STOP: (2, {}),
}


def _map(frame: Any, what: str) -> dict:
    try:
        body = P.unpack(frame)
    except Exception as e:
        raise Refused(f"{what}: not msgpack ({type(e).__name__})") from None
    if not isinstance(body, dict):
        raise Refused(f"{what}: a {type(body).__name__}, not a map")
    return body


def _check(body: dict, spec: dict[str, Check], what: str) -> dict:
    for name, check in spec.items():
        if not check(body.get(name)):
            raise Refused(f"{what}: bad field {name!r}: {body.get(name)!r:.80}")
    return body


def coordinator_request(frames: list) -> dict:
    """The request of a coordinator message (``[identity, request]``), checked; raises :class:`Refused`."""
    if len(frames) != 2:
        raise Refused(f"coordinator message of {len(frames) - 1} frames, not 1")
    body = _map(frames[1].bytes, "coordinator request")
    op = body.get("op")
    if not isinstance(op, str) or op not in _COORDINATOR:
        raise Refused(f"unknown coordinator request {op!r:.80}")
    return _check(body, _COORDINATOR[op], f"coordinator request {op!r}")


def data_message(frames: list) -> tuple[Op, bytes, dict | None]:
    """``(op, token or request id, its map)`` of a data message (``[identity, op, key, ...]``),
    checked; raises :class:`Refused`. The rows frame of ``DATA`` must be the 8-byte row count."""
    if len(frames) < 3:
        raise Refused(f"data message of {len(frames) - 1} frames")
    try:
        op = Op(frames[1].bytes)
        more, spec = _DATA[op]
    except (ValueError, KeyError):
        raise Refused(f"unknown data op {frames[1].bytes[:16]!r}") from None
    if len(frames) != 2 + more:
        raise Refused(f"data message {op.value!r} of {len(frames) - 1} frames, not {1 + more}")
    key = frames[2].bytes
    if not key or len(key) > MAX_NAME:
        raise Refused(f"data message {op.value!r}: bad key of {len(key)} bytes")
    if op in (Op.BEGIN, Op.DATA, Op.END) and not key.isascii():
        raise Refused(f"data message {op.value!r}: the write token is not ASCII")
    if op is Op.DATA:
        if len(frames[3].bytes) != P.ROWS.size:
            raise Refused(f"data message {op.value!r}: a row count of {len(frames[3].bytes)} bytes")
        return op, key, None
    what = f"data message {op.value!r}"
    return op, key, _check(_map(frames[3].bytes, what), spec, what)


class RefusalLog:
    """Counts refused messages and logs them on stderr: the first 20, then every power of two
    (a flood of garbage must not flood the log)."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.count = 0

    def __call__(self, where: str, reason: str) -> None:
        """One message to ``where`` (an endpoint) was refused for ``reason``."""
        self.count += 1
        n = self.count
        if n <= 20 or n & (n - 1) == 0:
            print(f"spark_bridge worker {self.worker}: refused a message to {where} ({n} so far): {reason}",
                  file=sys.stderr, flush=True)


def arrow_schema(stream: str, fields: list | None, schema: bytes) -> str | None:
    """Why the Arrow IPC ``schema`` of a write to ``stream`` cannot be staged (it does not decode,
    or differs from the declared ``fields``), or None."""
    import pyarrow as pa

    from . import schema as S

    try:
        actual = S.parse(pa.ipc.read_schema(pa.py_buffer(schema)))
    except Exception as e:
        return f"stream '{stream}': the write's Arrow schema does not decode ({type(e).__name__})"
    return None if fields is None else S.mismatch(stream, fields, actual)


def arrow_batch(schema: bytes, body: Any, rows: int) -> str | None:
    """Why ``body`` is not a record batch of ``rows`` rows of the Arrow IPC ``schema``, or None."""
    import pyarrow as pa

    try:
        rb = pa.ipc.read_record_batch(pa.py_buffer(body.buffer if hasattr(body, "buffer") else body),
                                      pa.ipc.read_schema(pa.py_buffer(schema)))
        rb.validate()
    except Exception as e:
        return f"a record batch that does not decode ({type(e).__name__})"
    if rb.num_rows != rows:
        return f"a record batch of {rb.num_rows} rows announced as {rows}"
    return None
