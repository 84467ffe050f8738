"""A job secret: who may talk to a job.

With a secret configured, every ZeroMQ socket a job opens (worker-to-worker links, the Spark
bridge's coordinator and data ports) uses ZeroMQ's CURVE mechanism: traffic is encrypted, and a
server admits only clients that prove they know the secret. Every party derives the same key pairs
from the secret text, so nothing but the secret itself has to be distributed:

- the *server* key pair: servers (``bind``) present it; clients need its public half to connect;
- the *client* key pair: clients present it; a server's ZAP handler (:meth:`JobSecret.guard`)
  admits a connection only if the client's public key is this one.

A party without the secret can neither complete the CURVE handshake (it lacks the server's public
key) nor pass the ZAP check (it lacks the client's secret key), so it can send nothing that reaches
the job's code. Without a secret, sockets use ZeroMQ's NULL mechanism, as before.

The secret comes from ``--secret-file`` / the ``TIMELY_SECRET`` environment variable (launcher) or
the ``secret`` option (Spark reader and writer); see :func:`resolve`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils import z85

from ..errors import TimelyError

#: Environment variable holding the job secret (the text itself).
ENV = "TIMELY_SECRET"
#: Environment variable naming a file whose contents (stripped) are the job secret.
ENV_FILE = "TIMELY_SECRET_FILE"
#: ZAP domain of the job's CURVE servers.
DOMAIN = "timely"
#: Bytes a frame grows by under CURVE, rounded up: libzmq encrypts each frame into a MESSAGE
#: command (its 8-byte name, an 8-byte nonce, a flags byte and a 16-byte MAC: 33 bytes more), and
#: a receiver's ``MAXMSGSIZE`` counts the encrypted frame (add it to the limit of a secured socket).
CURVE_OVERHEAD = 64


class SecretError(TimelyError, ValueError):
    """A job secret that cannot be used (empty, unreadable file, no CURVE support in libzmq)."""


def _keypair(text: str, role: str) -> tuple[bytes, bytes]:
    # A Curve25519 secret key is any 32 bytes (the library clamps it), so a hash of the secret and
    # the role is one; the public key follows from it.
    secret = z85.encode(hashlib.sha256(f"timely-curve/{role}/".encode() + text.encode()).digest())
    return zmq.curve_public(secret), secret


@dataclass(frozen=True)
class JobSecret:
    """The CURVE key pairs every holder of one secret text derives alike."""

    server_public: bytes = field(repr=False)
    server_secret: bytes = field(repr=False)
    client_public: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)

    @classmethod
    def from_text(cls, text: str) -> JobSecret:
        """The keys of the secret ``text`` (surrounding whitespace is ignored)."""
        text = text.strip()
        if not text:
            raise SecretError("the job secret is empty")
        if not zmq.has("curve"):
            raise SecretError("a job secret needs CURVE, which this libzmq was built without")
        server_public, server_secret = _keypair(text, "server")
        client_public, client_secret = _keypair(text, "client")
        return cls(server_public, server_secret, client_public, client_secret)

    @classmethod
    def from_file(cls, path: str) -> JobSecret:
        """The keys of the secret stored in the file ``path``."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise SecretError(f"cannot read the job secret file {path}: {exc.strerror}") from exc
        try:
            return cls.from_text(text)
        except SecretError as exc:
            raise SecretError(f"{exc} (file {path})") from None

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``bind``) a CURVE server of this job."""
        sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)

    def connect(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``connect``) a CURVE client of this job's servers."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)

    def guard(self, ctx: zmq.Context) -> Guard:
        """Start the ZAP handler of ``ctx``: its CURVE servers admit only clients of this secret.

        Call once per context, before its servers bind; stop it with :meth:`Guard.stop` after the
        context's sockets are closed."""
        return Guard(ctx, self.client_public)


class Guard:
    """A ZAP handler thread admitting only CURVE clients that present one public key."""

    def __init__(self, ctx: zmq.Context, client_public: bytes) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self._auth: Any = ThreadAuthenticator(ctx, log=_QuietLog())
        self._auth.start()
        self._auth.configure_curve_callback(DOMAIN, _OneKey(client_public))

    def stop(self) -> None:
        """Stop the handler thread (idempotent)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class _OneKey:
    """pyzmq's credentials provider: admit exactly one client key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def callback(self, domain: str, key: bytes) -> bool:
        # pyzmq hands the client key Z85-encoded
        return bool(domain == DOMAIN and key == self._key)


class _QuietLog:
    """A logger for pyzmq's authenticator that drops its per-connection debug lines."""

    def debug(self, *args: Any, **kwargs: Any) -> None:
        pass

    info = debug

    def warning(self, *args: Any, **kwargs: Any) -> None:
        pass

    error = warning
    exception = warning


def resolve(secret: str | JobSecret | None = None, secret_file: str | None = None) -> JobSecret | None:
    """The job secret to use: ``secret`` (text or keys), else the file ``secret_file``, else the
    environment (``TIMELY_SECRET``, then the file named by ``TIMELY_SECRET_FILE``), else ``None``
    (no secret: sockets are open to whoever can reach them). A variable that is set counts, even
    when empty: an empty (or blank) one is a :class:`SecretError` naming it, never "no secret"."""
    if isinstance(secret, JobSecret):
        return secret
    if secret is not None:
        return JobSecret.from_text(secret)
    if secret_file is not None:
        return JobSecret.from_file(secret_file)
    if ENV in os.environ:
        try:
            return JobSecret.from_text(os.environ[ENV])
        except SecretError as exc:
            raise SecretError(f"{exc} (environment variable {ENV})") from None
    if ENV_FILE in os.environ:
        if not os.environ[ENV_FILE].strip():
            raise SecretError(f"the environment variable {ENV_FILE} is set but empty: it names no job secret file")
        return JobSecret.from_file(os.environ[ENV_FILE])
    return None
