"""What a worker's ``ROUTER`` accepts from a connection that has not greeted it yet.

Anyone who can reach a worker's endpoint can open a connection to it. Until that connection's
``HELLO`` carries the job token (and, with a job secret, before it can even open one), nothing it
sends reaches the job: :func:`read_hello` validates every frame (count, sizes, kind, payload) and
:func:`hello_rejection` the greeting itself. A bad message is refused, counted and logged at most
once per :data:`LOG_INTERVAL` seconds (:class:`Refusals`), never fatal. A message of more than two
frames (a ``DATA_BUFFERS`` message, or garbage) is refused like any other: only a greeted peer's
messages may have more. No registered msgpack extension ever decodes a stranger's bytes.

Memory. ZeroMQ's ``MAXMSGSIZE`` on the ``ROUTER`` (set from ``max_message_bytes``) disconnects a
peer as soon as a frame's size header exceeds the limit, before buffering it; the frames of one
message that pass it are buffered by ZeroMQ until the message is complete (ZeroMQ has no limit on
the number of frames), which only a job secret keeps strangers from doing.
"""
from __future__ import annotations

import hmac
import sys
import time
from typing import Any

import zmq

from .errors import FramingError
from .framing import HEADER, VERSION, Kind, decode_untrusted, unpack_header

#: Largest ``HELLO`` payload accepted (a real one is well under 200 bytes besides its token).
MAX_HELLO_BYTES = 1024
#: Longest job token, in bytes (UTF-8): a ``HELLO`` carrying one of them and the largest values of
#: its other fields stays within :data:`MAX_HELLO_BYTES` (:func:`check_token`).
MAX_TOKEN_BYTES = 900

#: Seconds between two log lines about refused messages.
LOG_INTERVAL = 10.0

_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)


def check_token(token: str, name: str = "the job token") -> None:
    """Raise :class:`ValueError` (naming it ``name``) unless ``token`` can travel in a ``HELLO``:
    text of at most :data:`MAX_TOKEN_BYTES` bytes in UTF-8. A longer one would be refused by every
    peer, and the job would wait out its start-up timeout."""
    if not isinstance(token, str):
        raise TypeError(f"{name} must be text (str), not {type(token).__name__}")
    try:
        size = len(token.encode())
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid UTF-8 text") from None
    if size > MAX_TOKEN_BYTES:
        raise ValueError(f"{name} is {size} bytes long (UTF-8); at most {MAX_TOKEN_BYTES} are allowed")


def read_hello(router: zmq.Socket) -> tuple[int, Any] | str:
    """Read the rest of a message whose routing id was just received from ``router`` and return
    the claimed worker index and decoded payload of a ``HELLO``, or why it is not a valid one.

    Every frame of the message is consumed, whatever it holds; none is copied (ZeroMQ already
    holds them, each at most ``MAXMSGSIZE`` bytes).
    """
    frames: list[Any] = []
    count = 0
    while router.getsockopt(_RCVMORE):
        frame = router.recv(_NOBLOCK, copy=False)
        count += 1
        if count <= 2:
            frames.append(frame)
    if count != 2:
        return f"a message of {count} frames (expected 2)"
    head, payload = frames
    if len(head) != HEADER.size:
        return f"a header frame of {len(head)} bytes (expected {HEADER.size})"
    try:
        kind, source, _, _ = unpack_header(head.bytes)
    except FramingError as exc:
        return f"a malformed header ({exc})"
    if kind != Kind.HELLO:
        return f"a {kind.name} message (only a HELLO is accepted)"
    if len(payload) > MAX_HELLO_BYTES:
        return f"a HELLO of {len(payload)} bytes (at most {MAX_HELLO_BYTES})"
    try:
        return source, decode_untrusted(payload.bytes)
    except Exception as exc:  # any malformed msgpack: ValueError, ExtraData, recursion...
        return f"an undecodable HELLO ({type(exc).__name__})"


def hello_rejection(info: Any, source: int, token: str, peers: int, max_message_bytes: int,
                    known: bool, greeted: bool) -> str | None:
    """Why a ``HELLO`` claiming to come from worker ``source`` must be rejected, or ``None``.

    ``info`` is its decoded payload; ``known``: ``source`` is another worker of this job;
    ``greeted``: that worker already greeted us. A peer of another job (another token) is
    rejected, so jobs never cross-talk; so is one with another message size limit (it would send
    messages we disconnect on, or split them needlessly).
    """
    if not isinstance(info, dict):
        info = {}
    claimed = info.get("token")
    if not isinstance(claimed, str) or not hmac.compare_digest(claimed.encode(), token.encode()):
        return "wrong job token (the connection belongs to another job)"
    if info.get("version") != VERSION:
        return f"protocol version {info.get('version')}, expected {VERSION}"
    if info.get("peers") != peers:
        return f"job size mismatch: this job has {peers} workers, the peer expects {info.get('peers')}"
    if not known or info.get("index") != source:
        return f"bad worker index {source}"
    if info.get("max_message_bytes") != max_message_bytes:
        return (f"message size limit mismatch: this worker's max_message_bytes is {max_message_bytes}, "
                f"the peer's {info.get('max_message_bytes')}")
    if greeted:
        return f"worker {source} is already connected"
    return None


class Refusals:
    """Counts the messages worker ``index`` refused and logs them to stderr, rate-limited: the
    first at once, then at most one summary line per :data:`LOG_INTERVAL` seconds."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.count = 0  #: messages refused so far
        self._logged = 0
        self._next_log = 0.0

    def refuse(self, reason: str) -> None:
        """Count one refused message (``reason``: what it was) and log it if the rate allows."""
        self.count += 1
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + LOG_INTERVAL
            unlogged = self.count - self._logged - 1
            more = f" ({unlogged} more refused since the last report)" if unlogged else ""
            self._log(f"refused {reason} from a connection that has not completed the handshake{more}")

    def flush(self) -> None:
        """Log the refusals not logged yet (at close)."""
        if self.count > self._logged:
            self._log(f"refused {self.count - self._logged} more messages from connections that had not "
                      f"completed the handshake ({self.count} in all)")

    def _log(self, line: str) -> None:
        self._logged = self.count
        try:
            sys.stderr.write(f"timely: worker {self.index}: {line}\n")
        except (OSError, ValueError):
            pass  # a closed stderr must not break the job
