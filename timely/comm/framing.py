"""Wire framing of the ZeroMQ transport.

Every ZeroMQ message between two workers has exactly two frames:

* frame 0, a fixed 16-byte header, ``struct`` format ``<BBHIQ``:
  ``version`` (u8), ``kind`` (u8, a :class:`Kind`), ``source`` worker (u16), ``channel`` (u32) and
  ``seq`` (u64, the per-(source, target) sequence number of ``DATA`` messages);
* frame 1, a msgpack payload: the pushed message for ``DATA``, a small control record otherwise.

One pushed message (a batch of records, a progress batch) is one ZeroMQ message: records are never
sent one by one.

Payloads are decoded with ``use_list=False``: tuples round-trip as tuples, and **lists arrive as
tuples** too (msgpack has one array type). Map keys may be any hashable msgpack value (ints,
tuples), and ``bytes`` stay ``bytes`` (``use_bin_type=True``), ``str`` stay ``str``.
"""
from __future__ import annotations

import struct
from enum import IntEnum
from typing import Any

import msgpack

from .errors import FramingError

#: Protocol version carried by every header; peers with another version are rejected.
VERSION = 1

#: The header frame: version, kind, source worker, channel id, sequence number.
HEADER = struct.Struct("<BBHIQ")

#: Largest worker index and channel id the header can carry.
MAX_SOURCE = 0xFFFF
MAX_CHANNEL = 0xFFFF_FFFF


class Kind(IntEnum):
    """What a framed message carries."""

    DATA = 0      #: a pushed message for ``channel``
    HELLO = 1     #: connector -> listener: ``{"token", "index", "peers", "version", "max_message_bytes"}``
    WELCOME = 2   #: listener -> connector: the handshake succeeded
    REJECT = 3    #: listener -> connector: the handshake failed; payload is the reason (str)
    GOODBYE = 4   #: the sender closed cleanly and will send nothing more
    ABORT = 5     #: the sender failed; payload is a one-line reason (str)
    ACK = 6       #: listener -> connector: your GOODBYE (and so everything before it) was read


def pack_header(kind: Kind, source: int, channel: int = 0, seq: int = 0) -> bytes:
    """Return the 16-byte header frame."""
    return HEADER.pack(VERSION, kind, source, channel, seq)


def unpack_header(frame: bytes) -> tuple[Kind, int, int, int]:
    """Return ``(kind, source, channel, seq)`` of a header frame; raise :class:`FramingError`."""
    if len(frame) != HEADER.size:
        raise FramingError(f"header frame has {len(frame)} bytes, expected {HEADER.size}")
    version, kind, source, channel, seq = HEADER.unpack(frame)
    if version != VERSION:
        raise FramingError(f"protocol version {version}, expected {VERSION}")
    try:
        return Kind(kind), source, channel, seq
    except ValueError:
        raise FramingError(f"unknown message kind {kind}") from None


_packer = msgpack.Packer(use_bin_type=True)


def encode(obj: Any) -> bytes:
    """Serialise ``obj`` with msgpack; raise ``TypeError`` naming the offending type."""
    try:
        return _packer.pack(obj)
    except BaseException:
        _packer.reset()  # a failed pack may leave partial bytes in the shared buffer
        raise


def encode_items(items: list) -> memoryview:
    """The msgpack encodings of ``items``, one after another: an array's body without its header.

    Encoding a batch's parts as soon as they are cut (while their records are still in the CPU's
    cache) and joining the bodies later with :func:`encode_gathered` costs a third of encoding the
    gathered records at the end: the records of one destination lie scattered in memory."""
    packed = encode(items)
    n = len(items)
    return memoryview(packed)[1 if n < 0x10 else 3 if n < 0x10000 else 5:]


_PAIR = b"\x92"  # a msgpack array of two elements


def encode_gathered(head: Any, bodies: list, count: int) -> bytes:
    """``encode((head, items))``, where ``items`` are the ``count`` items whose encodings are
    ``bodies`` (each from :func:`encode_items`): the receiver decodes ``(head, tuple(items))``."""
    if count < 0x10:
        array = bytes((0x90 | count,))
    elif count < 0x10000:
        array = b"\xdc" + count.to_bytes(2, "big")
    else:
        array = b"\xdd" + count.to_bytes(4, "big")
    return b"".join([_PAIR, encode(head), array, *bodies])


def decode(buf: Any) -> Any:
    """Deserialise a msgpack payload (``bytes`` or a buffer); arrays come back as tuples."""
    return msgpack.unpackb(buf, use_list=False, raw=False, strict_map_key=False)
