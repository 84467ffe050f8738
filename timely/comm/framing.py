"""Wire framing of the ZeroMQ transport.

A ZeroMQ message between two workers has two frames, or more for ``DATA_BUFFERS``:

* frame 0, a fixed 16-byte header, ``struct`` format ``<BBHIQ``:
  ``version`` (u8), ``kind`` (u8, a :class:`Kind`), ``source`` worker (u16), ``channel`` (u32) and
  ``seq`` (u64, the per-(source, target) sequence number of ``DATA`` and ``DATA_BUFFERS`` messages,
  one sequence for both);
* frame 1, a msgpack payload: the pushed message for ``DATA``, the message's ``head`` for
  ``DATA_BUFFERS``, a small control record otherwise;
* ``DATA_BUFFERS`` only: frames 2 .. 2+n-1, the message's ``n`` buffers (n >= 0), raw bytes, one
  frame each, sent and received without copying. The receiver gets ``(head, buffers)``, the
  buffers as read-only ``memoryview`` objects over the received frames. The number of buffers is
  the number of frames (ZeroMQ delivers a multipart message whole or not at all).
* ``BUNDLE``: frame 1 carries several ``DATA`` payloads for one peer, in push order
  (:func:`bundle`: their count (u32), each one's channel and length (u32, u32), then the payloads);
  the header's ``channel`` is unused and the bundle takes one ``seq``.

One pushed message (a batch of records, a progress batch) is one ZeroMQ message, or one part of a
``BUNDLE``: records are never sent one by one. A dataflow's flush (every channel's gathered
records, then its progress) is corked (``ZmqAllocator.cork``), so it costs one ZeroMQ message per
peer, not one per channel and peer; a bundle stays under ``max_message_bytes``.

Payloads are decoded with ``use_list=False``: tuples round-trip as tuples, and **lists arrive as
tuples** too (msgpack has one array type). Map keys may be any hashable msgpack value (ints,
tuples), and ``bytes`` stay ``bytes`` (``use_bin_type=True``), ``str`` stay ``str``.

Extensions. :func:`register_extension` teaches every payload (``push``, gathered items, the head
of ``push_buffers``) one more type, packed as a msgpack ``ExtType`` of its code. The layer knows no
such type itself; a payload holding an ext code nobody registered fails to decode
(:class:`FramingError` naming the code).
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any

import msgpack
import zmq

from .errors import FramingError

#: Protocol version carried by every header; peers with another version are rejected.
#: 2: ``DATA_BUFFERS`` (a version-1 worker would ignore it and lose the sequence).
#: 3: ``BUNDLE`` (likewise for a version-2 worker).
#: 4: the payloads above this layer changed (progress updates name locations by index): a worker
#: of version 3 would fail on them later, with a less clear error.
VERSION = 4

#: The header frame: version, kind, source worker, channel id, sequence number.
HEADER = struct.Struct("<BBHIQ")

#: Largest worker index and channel id the header can carry.
MAX_SOURCE = 0xFFFF
MAX_CHANNEL = 0xFFFF_FFFF

_RCVMORE, _NOBLOCK = int(zmq.RCVMORE), int(zmq.NOBLOCK)


class Kind(IntEnum):
    """What a framed message carries."""

    DATA = 0      #: a pushed message for ``channel``
    HELLO = 1     #: connector -> listener: ``{"token", "index", "peers", "version", "max_message_bytes"}``
    WELCOME = 2   #: listener -> connector: the handshake succeeded
    REJECT = 3    #: listener -> connector: the handshake failed; payload is the reason (str)
    GOODBYE = 4   #: the sender closed cleanly and will send nothing more
    ABORT = 5     #: the sender failed; payload is a one-line reason (str)
    ACK = 6       #: listener -> connector: your GOODBYE (and so everything before it) was read
    DATA_BUFFERS = 7  #: a pushed ``(head, buffers)`` for ``channel``: msgpack head, then one frame per buffer
    BUNDLE = 8    #: several DATA payloads for one peer, in order (:func:`bundle`): one message, one seq


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


# -- extensions ---------------------------------------------------------------------------------
_codes: dict[type, int] = {}  # registered class -> its ext code
_encoders: dict[type, Callable[[Any], Any]] = {}
_classes: dict[int, type] = {}  # ext code -> registered class
_decoders: dict[int, Callable[[bytes], Any]] = {}


def register_extension(code: int, cls: type, encode: Callable[[Any], Any], decode: Callable[[bytes], Any]) -> None:
    """Pack every ``cls`` object inside any payload as msgpack ``ExtType(code, encode(obj))``
    (``encode`` returns bytes or another buffer) and unpack it with ``decode(data)``.

    Instances of subclasses of ``cls`` are packed the same way (the nearest registered class in
    their MRO wins) and come back as whatever ``decode`` returns; ``cls`` must not be (or derive
    from) a type msgpack packs itself (``int``, ``str``, ``bytes``, ``tuple``, ``dict`` ...: those
    never reach the extensions). ``encode`` may itself call :func:`encode`. ``code`` is 0..127; every worker
    of a job must register the same extensions, before its first message with one. Registering
    ``cls`` again under its code replaces the functions; a code taken by another class, or a class
    already registered under another code, raises ``ValueError``. Payloads without such objects
    cost nothing more (msgpack consults the extensions only for types it does not know).
    """
    if not isinstance(code, int) or not 0 <= code <= 127:
        raise ValueError(f"extension code must be an int in 0..127, not {code!r}")
    if not isinstance(cls, type):
        raise TypeError(f"extension class must be a type, not {cls!r}")
    taken = _classes.get(code)
    if taken is not None and taken is not cls:
        raise ValueError(f"extension code {code} is already registered for {taken.__qualname__}")
    if _codes.get(cls, code) != code:
        raise ValueError(f"{cls.__qualname__} is already registered under extension code {_codes[cls]}")
    _codes[cls] = code
    _encoders[cls] = encode
    _classes[code] = cls
    _decoders[code] = decode


def _pack_extension(obj: Any) -> msgpack.ExtType:
    """msgpack's ``default`` hook: called only for objects msgpack cannot pack itself."""
    global _packer
    for klass in type(obj).__mro__:
        code = _codes.get(klass)
        if code is not None:
            # The shared packer is in the middle of packing the outer message: an encoder that
            # calls encode() (nested messages) must get a packer of its own meanwhile.
            outer = _packer
            _packer = _spare_packers.pop() if _spare_packers else _new_packer()
            try:
                data = _encoders[klass](obj)
            finally:
                _spare_packers.append(_packer)
                _packer = outer
            return msgpack.ExtType(code, data if isinstance(data, bytes) else bytes(data))
    raise TypeError(f"can not serialize {type(obj).__qualname__!r} object")


def _unpack_extension(code: int, data: bytes) -> Any:
    """msgpack's ``ext_hook``: called only for ``ExtType`` values."""
    decoder = _decoders.get(code)
    if decoder is None:
        raise FramingError(f"a message holds msgpack extension type {code}, which no register_extension "
                           "on this worker knows (do all workers register the same extensions?)")
    return decoder(data)


def _refuse_extension(code: int, data: bytes) -> Any:
    raise FramingError(f"msgpack extension type {code} in a message from an unknown connection")


# -- payloads -----------------------------------------------------------------------------------
def _new_packer() -> msgpack.Packer:
    return msgpack.Packer(use_bin_type=True, default=_pack_extension)


_packer = _new_packer()  # shared by every encode (one at a time; see _pack_extension)
_spare_packers: list[msgpack.Packer] = []  # for encodes nested in an extension's encoder


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


_BUNDLE_COUNT = struct.Struct("<I")
_BUNDLE_PART = struct.Struct("<II")  # channel, payload bytes


def bundle(parts: list[tuple[int, bytes]]) -> bytes:
    """One ``BUNDLE`` payload carrying ``(channel, payload)`` parts: their count, each part's
    channel and length, then the payloads one after another."""
    index = [_BUNDLE_COUNT.pack(len(parts))]
    index += [_BUNDLE_PART.pack(channel, len(payload)) for channel, payload in parts]
    return b"".join([*index, *(payload for _, payload in parts)])


def bundle_overhead(parts: int) -> int:
    """The bytes a bundle of ``parts`` parts adds to their payloads."""
    return _BUNDLE_COUNT.size + parts * _BUNDLE_PART.size


def unbundle(payload: Any) -> list[tuple[int, memoryview]]:
    """The ``(channel, payload)`` parts of a :func:`bundle` (views into ``payload``); raise
    :class:`FramingError` for a malformed one."""
    view = memoryview(payload)
    try:
        (count,) = _BUNDLE_COUNT.unpack_from(view, 0)
        at = _BUNDLE_COUNT.size
        heads = [_BUNDLE_PART.unpack_from(view, at + i * _BUNDLE_PART.size) for i in range(count)]
    except struct.error as exc:
        raise FramingError(f"malformed bundle: {exc}") from None
    at += count * _BUNDLE_PART.size
    parts = []
    for channel, size in heads:
        if at + size > len(view):
            raise FramingError("malformed bundle: its parts overrun the message")
        parts.append((channel, view[at:at + size]))
        at += size
    if at != len(view):
        raise FramingError("malformed bundle: bytes after its last part")
    return parts


def decode(buf: Any) -> Any:
    """Deserialise a msgpack payload (``bytes`` or a buffer); arrays come back as tuples, and
    registered extensions as their objects (an unregistered ext code raises :class:`FramingError`)."""
    return msgpack.unpackb(buf, use_list=False, raw=False, strict_map_key=False, ext_hook=_unpack_extension)


def decode_untrusted(buf: Any) -> Any:
    """:func:`decode` for a connection that has not completed the handshake: no extension's
    decoder ever runs on a stranger's bytes (any ext type raises :class:`FramingError`)."""
    return msgpack.unpackb(buf, use_list=False, raw=False, strict_map_key=False, ext_hook=_refuse_extension)


def recv_buffer_frames(socket: zmq.Socket) -> tuple[tuple[memoryview, ...], int]:
    """Receive the remaining frames of the message being read from ``socket``, without copying:
    read-only ``memoryview`` objects over the frames (each keeps its frame alive), and their
    total bytes."""
    frames = []
    size = 0
    while socket.getsockopt(_RCVMORE):
        view = socket.recv(_NOBLOCK, copy=False).buffer.toreadonly()  # 'B' format: len is bytes
        size += len(view)
        frames.append(view)
    return tuple(frames), size


def buffer_frames(buffers: Iterable[Any]) -> tuple[tuple[memoryview, ...], int]:
    """``buffers`` as frames to send without copying, and their total bytes: a ``memoryview`` of
    each (``TypeError`` for an object without the buffer protocol, ``ValueError`` for a
    non-contiguous one), validated before any frame is sent (a message is never half-sent)."""
    views = tuple([memoryview(b) for b in buffers])
    size = 0
    for view in views:
        if not view.contiguous:
            raise ValueError("push_buffers: a buffer is not contiguous in memory")
        size += view.nbytes
    return views, size
