"""The job secret (timely/comm/secret.py): key derivation and who a guarded CURVE server admits."""
from __future__ import annotations

import time

import pytest
import zmq

from timely.comm.secret import ENV, ENV_FILE, JobSecret, SecretError, resolve


def test_every_holder_of_a_secret_derives_the_same_keys_and_others_differ():
    a, b, c = JobSecret.from_text("s3cret"), JobSecret.from_text(" s3cret\n"), JobSecret.from_text("other")
    assert a == b
    assert a.server_public != c.server_public and a.client_public != c.client_public
    assert a.server_public != a.client_public
    assert zmq.curve_public(a.server_secret) == a.server_public
    assert "s3cret" not in repr(a) and a.server_secret.decode() not in repr(a)


def test_an_empty_or_unreadable_secret_is_refused_naming_the_file(tmp_path):
    with pytest.raises(SecretError, match="empty"):
        JobSecret.from_text("  \n")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SecretError, match=f"empty.*{empty}"):
        JobSecret.from_file(str(empty))
    with pytest.raises(SecretError, match=f"cannot read the job secret file {tmp_path / 'missing'}"):
        JobSecret.from_file(str(tmp_path / "missing"))


def test_resolve_prefers_the_explicit_secret_then_the_file_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(ENV_FILE, raising=False)
    assert resolve() is None
    path = tmp_path / "secret"
    path.write_text("from-file\n")
    monkeypatch.setenv(ENV_FILE, str(path))
    assert resolve() == JobSecret.from_text("from-file")
    monkeypatch.setenv(ENV, "from-env")
    assert resolve() == JobSecret.from_text("from-env")
    assert resolve(secret_file=str(path)) == JobSecret.from_text("from-file")
    assert resolve("given") == JobSecret.from_text("given")
    keys = JobSecret.from_text("keys")
    assert resolve(keys) is keys


@pytest.mark.timeout(30)
def test_a_guarded_server_hears_only_clients_that_know_the_secret():
    good, bad = JobSecret.from_text("s3cret"), JobSecret.from_text("other")
    ctx = zmq.Context()
    guard = good.guard(ctx)
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    good.serve(server)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    clients = zmq.Context()
    socks = []  # kept open: a closed DEALER (LINGER 0) drops what it has not sent yet
    try:
        def send(payload: bytes, secret: JobSecret | None = None) -> None:
            sock = clients.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if secret is not None:
                secret.connect(sock)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send(payload)
            socks.append(sock)

        send(b"plain")
        send(b"wrong secret", bad)
        # knows the server's public key (it is no secret to CURVE) but not the clients' key pair
        send(b"own keys", JobSecret(good.server_public, b"", *zmq.curve_keypair()))
        send(b"member", good)
        heard = []
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if server.poll(50):
                heard.append(server.recv_multipart()[-1])
        assert heard == [b"member"]
    finally:
        clients.destroy(0)
        server.close(0)
        guard.stop()
        guard.stop()  # idempotent
        ctx.term()


def test_a_secret_error_is_a_timely_error():
    from timely.errors import TimelyError

    with pytest.raises(TimelyError):
        JobSecret.from_text("")
