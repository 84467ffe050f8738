"""The live dashboard of a job (``--dashboard PORT``), served by worker 0 with Flask (werkzeug's
threaded server, on a thread of its own) from assets shipped in this package (Chart.js 3.9.1, MIT,
in ``static/``): the page works without internet access.

The page polls ``GET /api/state`` (the metrics hub's view: per-operator rates, per-worker load, lags,
per-bin load and owners; the dataflow graph; and, where a library connected a :class:`Steering`
such as Megaphone's, its routing table, migration steps and decisions) and posts rebalance requests
to ``POST /api/rebalance``. A request is handed to the steering object, which answers it on the
worker's own thread (a Megaphone controller is not thread-safe); a malformed one gets a 400 reply
with the reason, and the job runs on.
"""
from __future__ import annotations

import json
import logging
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Protocol

from flask import Flask, jsonify, request, send_from_directory
from werkzeug.serving import make_server

STATIC = Path(__file__).with_name("static")


#: The largest rebalance request body served (bytes): a table or moves for 2^16 bins fit well.
MAX_REQUEST_BYTES = 4 << 20
#: At most this many bins in a job (megaphone.table.MAX_K = 16).
MAX_BINS = 1 << 16

class Steering(Protocol):
    """What a library offers the dashboard: a thread-safe ``status()`` and ``submit(request, timeout)``
    returning ``(ok, reply)``."""

    def status(self) -> dict[str, Any]:
        """What the page shows of the library (routing table, migrations, decisions), JSON-serialisable;
        called from the server's thread."""

    def submit(self, req: Any, timeout: float) -> tuple[bool, dict[str, Any]]:
        """Hand a rebalance request to the job and wait up to ``timeout`` seconds for its answer: ``(ok, reply)``."""


def _bindable(host: str, port: int) -> None:
    """Raise the ``OSError`` of binding ``host:port`` (a port in use), if any."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server itself binds
        s.bind((host.strip("[]"), port))


class Dashboard:
    """Serves the page and its API at ``host:port`` (0: a free port; :attr:`port` is the bound one)
    over worker 0's ``metrics`` (a :class:`timely.metrics.WorkerMetrics` with a hub)."""

    def __init__(self, metrics: Any, port: int, host: str = "127.0.0.1") -> None:
        self.metrics = metrics
        self.steering: Steering | None = None
        # Bound to loopback, the page answers only requests naming a loopback host (a web page
        # elsewhere cannot reach it through DNS rebinding); rebalances must be JSON (no form posts).
        self._hosts = {"127.0.0.1", "localhost", "[::1]"} if host in ("127.0.0.1", "localhost", "::1") else None
        self.app = self._app()
        try:
            _bindable(host, port)  # (werkzeug would print its own advice, then sys.exit(1), on a port in use)
            self._server = make_server(host, port, self.app, threaded=True)
        except OSError as e:
            raise OSError(f"the dashboard cannot listen on {host}:{port}: {e.strerror or e}") from None
        except SystemExit:  # werkzeug's exit, should the port be taken between the two binds
            raise OSError(f"the dashboard cannot listen on {host}:{port}: Address already in use") from None
        self.port: int = self._server.server_port
        url_host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # (IPv6)
        self.url = f"http://{url_host}:{self.port}/"
        self._thread = threading.Thread(target=self._server.serve_forever, name="timely-dashboard", daemon=True)
        self._thread.start()

    def connect(self, steering: Steering) -> None:
        """Let the page see and start migrations through ``steering``."""
        self.steering = steering

    def state(self) -> dict[str, Any]:
        """What ``/api/state`` answers."""
        hub = self.metrics.hub
        out = hub.view() if hub is not None else {}
        try:
            out["graph"] = self.metrics.graph()
        except RuntimeError:  # the worker changed its dataflows meanwhile
            out["graph"] = {}
        out["steering"] = self.steering.status() if self.steering is not None else None
        return out

    def _app(self) -> Flask:
        app = Flask("timely.dashboard", static_folder=None)
        app.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES  # (413 beyond: a table of 2^16 bins needs < 1 MB)
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request on the job's stderr

        @app.before_request
        def loopback_only() -> Any:
            name = (request.host or "").rsplit(":", 1)[0] if not (request.host or "").endswith("]") else request.host
            if self._hosts is not None and name not in self._hosts:
                return jsonify({"ok": False, "error": f"host {request.host!r} is not this loopback dashboard"}), 403
            return None

        @app.errorhandler(413)
        def too_large(_: Any) -> Any:  # (Flask's own reply is an HTML page; the page reads JSON)
            return jsonify({"ok": False, "error": f"the request body is larger than {MAX_REQUEST_BYTES} bytes"}), 413

        @app.get("/")
        def index() -> Any:
            return send_from_directory(STATIC, "index.html")

        @app.get("/favicon.ico")
        def favicon() -> Any:
            return "", 204

        @app.get("/static/<path:name>")
        def static(name: str) -> Any:
            return send_from_directory(STATIC, name)

        @app.get("/api/state")
        def state() -> Any:
            return jsonify(self.state())

        @app.post("/api/rebalance")
        def rebalance() -> Any:
            if self.steering is None:
                return jsonify({"ok": False, "error": "this job has no migratable operator connected"}), 409
            try:
                req = json.loads(request.get_data()) if request.is_json else None
            except (ValueError, RecursionError):  # (deep nesting is a RecursionError, not a ValueError)
                req = None
            if not isinstance(req, dict):
                return jsonify({"ok": False, "error": "the request must be a JSON object"}), 400
            for key in ("moves", "table"):  # checked here, not on the worker's thread, whatever their size
                if isinstance(req.get(key), list) and len(req[key]) > MAX_BINS:
                    return jsonify({"ok": False, "error": f"{key} has {len(req[key])} entries: a job has at most "
                                                          f"{MAX_BINS} bins"}), 400
            ok, reply = self.steering.submit(req, 10.0)
            return jsonify({"ok": ok, **reply}), 200 if ok else 400

        return app

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=2)
        self._server.server_close()


def serve(metrics: Any, port: int, host: str = "127.0.0.1") -> Dashboard | None:
    """Start the dashboard; on failure (the port in use) print a clear error and return None: the job
    runs on without it."""
    try:
        return Dashboard(metrics, port, host)
    except OSError as e:
        sys.stderr.write(f"timely.dashboard: error: {e}; the job runs without the dashboard\n")
        return None
