"""The line from a barrier stage's tasks back to the Spark driver that submitted it.

The timely workers of :func:`spark_bridge.run` live in Spark tasks; the driver only learns their
results when the stage ends. While it runs, the tasks tell the driver what it needs earlier over a
small TCP listener the driver opens on its own address (``spark.driver.host``, the one executors
already reach): each run (a Spark stage attempt) that starts, with worker 0's bridge coordinator
endpoint; each timely worker that starts (host, pid, the checkpoint epoch it resumes from); and
each run's verdict. A message is one JSON line carrying the job's random key: anything else is
ignored. Sending never fails a task: the driver may be unreachable (the results still arrive
through Spark), so a send that fails is reported on stderr and dropped.
"""
from __future__ import annotations

import hmac
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: The longest message accepted, in bytes.
MAX_MESSAGE = 1 << 16
#: Seconds a task waits to deliver one message.
SEND_TIMEOUT = 5.0


class DriverLink:
    """The driver's listener: collects the events of one barrier job (see the module).

    ``bind`` is the interface to listen on, ``advertise`` the host the tasks connect to;
    ``on_event`` (if given) is called with every accepted event, on the listener's thread, before
    the event is in :attr:`events` (so before :meth:`wait_for` or :meth:`snapshot` can return it).
    """

    def __init__(self, bind: str, advertise: str, key: str, on_event: Callable[[dict], None] | None = None) -> None:
        self.key = key
        self.on_event = on_event
        self.events: list[dict] = []
        self._cond = threading.Condition()
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind, 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        port = self._sock.getsockname()[1]
        #: Where tasks send their events (``host:port``).
        self.address = f"[{advertise}]:{port}" if ":" in advertise else f"{advertise}:{port}"
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="spark-bridge-barrier-link", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                event = _read_event(conn, self.key)
            if event is None:
                continue
            # on_event first (it counts the runs): whoever sees the event in events or wait_for
            # sees what on_event derived from it too.
            if self.on_event is not None:
                try:
                    self.on_event(event)
                except Exception as e:  # a logging callback must not stop the listener
                    print(f"spark_bridge: barrier job event handler failed: {e!r}", file=sys.stderr)
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()

    def wait_for(self, match: Callable[[dict], bool], timeout: float, stop: Callable[[], bool] = lambda: False) -> dict:
        """The newest event ``match`` accepts, waiting up to ``timeout`` seconds (or until ``stop()``)
        for one; :class:`TimeoutError` if none came."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [e for e in self.events if match(e)]
                if found:
                    return found[-1]
                left = deadline - time.monotonic()
                if left <= 0 or stop():
                    raise TimeoutError("no such event from the barrier stage")
                self._cond.wait(min(left, 0.2))

    def snapshot(self) -> list[dict]:
        """Every event so far, oldest first."""
        with self._cond:
            return list(self.events)

    def close(self) -> None:
        """Stop listening (idempotent)."""
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        self._thread.join(2.0)


def _read_event(conn: socket.socket, key: str) -> dict | None:
    conn.settimeout(SEND_TIMEOUT)
    data = b""
    try:
        while not data.endswith(b"\n") and len(data) <= MAX_MESSAGE:
            chunk = conn.recv(MAX_MESSAGE)
            if not chunk:
                break
            data += chunk
        event = json.loads(data)
    except (OSError, ValueError):
        return None
    if not isinstance(event, dict) or not hmac.compare_digest(str(event.pop("key", "")), key):
        return None
    return event


def send(address: str | None, key: str, **event: Any) -> bool:
    """Send one event to the driver's link at ``address`` (``host:port``); False (reported on
    stderr) if it could not be delivered."""
    if not address:
        return False
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=SEND_TIMEOUT) as s:
            s.sendall(json.dumps({**event, "key": key}).encode() + b"\n")
        return True
    except OSError as e:
        print(f"spark_bridge: cannot tell the driver at {address} about {event.get('kind')!r}: {e}",
              file=sys.stderr, flush=True)
        return False
