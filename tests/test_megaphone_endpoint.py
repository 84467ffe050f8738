"""The controller's control endpoint (``megaphone.endpoint``): it answers table / status / rebalance
requests in msgpack or JSON from a controller's ``tick``, and rejects bad requests and undecodable
payloads without changing anything. Driven against a fake control input and probe.
"""
from __future__ import annotations

import json
import time

import msgpack
import pytest
import zmq
from megaphone_jobs import FakeControl, FakeProbe

from megaphone.controller import Controller
from megaphone.endpoint import ControlEndpoint, EndpointError
from megaphone.table import balanced


def ask(ctl: Controller, ep: ControlEndpoint, payload: bytes, timeout: float = 10.0) -> bytes:
    """Send raw ``payload`` to the endpoint and tick the controller until the reply arrives."""
    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(ep.endpoint)
        s.send(payload)
        deadline = time.monotonic() + timeout
        while not s.poll(5):
            ctl.tick()
            assert time.monotonic() < deadline, "no reply from the endpoint"
        return s.recv()
    finally:
        s.close(0)


def ask_msgpack(ctl, ep, req):
    return msgpack.unpackb(ask(ctl, ep, msgpack.packb(req)), raw=False, strict_map_key=False)


def ask_json(ctl, ep, req):
    return json.loads(ask(ctl, ep, json.dumps(req).encode()))


@pytest.fixture
def fake_endpoint():
    control, probe = FakeControl(k=3, peers=3), FakeProbe()
    ctl = Controller(control, probe)
    ep = ControlEndpoint(ctl, "tcp://127.0.0.1:*")
    try:
        yield ctl, ep, control, probe
    finally:
        ep.close()


@pytest.mark.timeout(30)
def test_endpoint_table_status_rebalance(fake_endpoint):
    ctl, ep, control, probe = fake_endpoint
    assert ep.endpoint.startswith("tcp://127.0.0.1:")
    r = ask_msgpack(ctl, ep, {"op": "table"})
    assert r == {"ok": True, "table": [0, 1, 2, 0, 1, 2, 0, 1], "planned": [0, 1, 2, 0, 1, 2, 0, 1],
                 "nbins": 8, "peers": 3}
    r = ask_json(ctl, ep, {"op": "rebalance", "table": [0, 0, 0, 0, 1, 2, 0, 1], "strategy": "fluid"})
    assert r == {"ok": True, "migration": 0, "steps": 2, "moves": 2, "strategy": "fluid"}
    # The tick that answered the request also issued the first step (nothing was in flight).
    assert control.sent == [(0, {1: 0})]
    assert not ctl.tick()  # the probe has not passed time 0
    s = ask_msgpack(ctl, ep, {"op": "status"})
    assert s["ok"] and s["busy"] and not s["done"] and s["steps"] == 2
    assert [e["bins"] for e in s["in_flight"]] == [[1]] and [e["bins"] for e in s["queued"]] == [[2]]
    assert s["in_flight"][0]["elapsed"] >= 0
    probe.frontier = 1
    control.time = 1
    ctl.tick()
    probe.frontier = 2
    ctl.tick()
    s = ask_json(ctl, ep, {"op": "status", "migration": 0})
    assert s["done"] and [e["bins"] for e in s["completed"]] == [[1], [2]]
    assert all(e["duration"] >= 0 for e in s["completed"])
    s = ask_json(ctl, ep, {"op": "status", "migration": 0, "since": 1})  # paging: from the 2nd on
    assert [e["bins"] for e in s["completed"]] == [[2]] and s["completed_count"] == 2
    s = ask_msgpack(ctl, ep, {"op": "status", "limit": 1})
    assert [e["bins"] for e in s["completed"]] == [[1]] and s["completed_count"] == 2
    r = ask_msgpack(ctl, ep, {"op": "rebalance", "moves": {3: 2, 5: 1}})  # int keys (msgpack)
    assert r["ok"] and r["moves"] == 2 and r["steps"] == 1  # batched: 0->2 and 2->1 form one matching
    r = ask_json(ctl, ep, {"op": "rebalance", "moves": [[3, 2]]})  # already planned there: no step
    assert r["ok"] and r["steps"] == 0
    r = ask_json(ctl, ep, {"op": "rebalance", "moves": {"0": 1}})  # JSON object keys are strings
    assert r["ok"] and r["moves"] == 1
    r = ask_msgpack(ctl, ep, {"op": "rebalance", "balanced": True, "strategy": "all_at_once"})
    assert r["ok"] and r["steps"] == 1
    assert ctl.planned_table == balanced(8, 3)
    assert ask_msgpack(ctl, ep, {"op": "table"})["planned"] == list(balanced(8, 3))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("req, error", [
    ({"op": "explode"}, "unknown op 'explode'"),
    ({"nop": 1}, "unknown op None"),
    ([1, 2], "must be a map"),
    ({"op": "rebalance", "table": [0] * 7}, "7 entries, expected one per bin (8)"),
    ({"op": "rebalance", "table": [0] * 7 + [3]}, "target table, bin 7: worker 3 does not exist (there are 3 workers)"),
    ({"op": "rebalance", "table": [0] * 7 + ["x"]}, "worker 'x' is not an integer"),
    ({"op": "rebalance", "table": "0,1"}, "'table' must be a list"),
    ({"op": "rebalance", "moves": [[8, 0]]}, "bin 8 does not exist (there are 8 bins)"),
    ({"op": "rebalance", "moves": [[1, -1]]}, "worker -1 does not exist"),
    ({"op": "rebalance", "moves": [[1, 0], [2, 3]]}, "move of bin 2 to worker 3: worker 3 does not exist"),
    ({"op": "rebalance", "moves": [[1]]}, "not a [bin, worker] pair"),
    ({"op": "rebalance", "moves": 5}, "'moves' must be"),
    ({"op": "rebalance"}, "exactly one of"),
    ({"op": "rebalance", "balanced": True, "moves": [[0, 1]]}, "exactly one of"),
    ({"op": "rebalance", "balanced": True, "strategy": "sudden"}, "unknown strategy 'sudden'"),
    ({"op": "status", "migration": 4}, "migration 4 does not exist"),
    ({"op": "status", "since": -1}, "'since' must be >= 0"),
    ({"op": "status", "limit": "all"}, "limit 'all' is not an integer"),
])
def test_endpoint_rejects_bad_requests(fake_endpoint, req, error):
    ctl, ep, control, probe = fake_endpoint
    before = (ctl.planned_table, len(ctl.events))
    r = ask_msgpack(ctl, ep, req)
    assert r["ok"] is False and error in r["error"]
    r = ask_json(ctl, ep, req) if isinstance(req, dict) else r
    assert r["ok"] is False and error in r["error"]
    assert (ctl.planned_table, len(ctl.events)) == before and control.sent == []


@pytest.mark.timeout(30)
def test_endpoint_rejects_undecodable_payloads(fake_endpoint):
    ctl, ep, _, _ = fake_endpoint
    assert "not valid JSON" in json.loads(ask(ctl, ep, b"{not json"))["error"]
    r = msgpack.unpackb(ask(ctl, ep, b"\xc1"), raw=False)
    assert r["ok"] is False and "not valid msgpack" in r["error"]


@pytest.mark.timeout(30)
def test_endpoint_poll_never_blocks(fake_endpoint):
    ctl, ep, _, _ = fake_endpoint
    t0 = time.monotonic()
    for _ in range(200):
        ctl.tick()
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(EndpointError, match="cannot bind"):
        ControlEndpoint(ctl, ep.endpoint)  # the address is taken
