"""A bridge sink's buffer driven directly: epochs in, Arrow IPC batches out, reads and releases,
without sockets or a dataflow."""
from __future__ import annotations

import pytest

pa = pytest.importorskip("pyarrow")

from spark_bridge.errors import BridgeError  # noqa: E402
from spark_bridge.schema import parse  # noqa: E402
from spark_bridge.sinkbuffer import SinkBuffer  # noqa: E402

FIELDS = parse("key bigint, name string")


def rows_of(buffer: SinkBuffer, batches: list) -> list:
    """(epoch, row) pairs of the batches of an answer, deserialised with the sink's schema."""
    return [(epoch, tuple(r.values())) for epoch, _rows, body in batches
            for r in pa.ipc.read_record_batch(pa.py_buffer(body), buffer.schema).to_pylist()]


def test_epochs_are_served_once_the_frontier_passes_them():
    b = SinkBuffer("out", FIELDS, False, 0)
    b.add(0, [(1, "a"), (2, "b")])
    b.add(1, [(3, "c")])
    b.add(0, [(4, "d")])
    b.advance(1)
    assert b.status() == {"ok": True, "empty": False, "frontier": 1, "max_seen": 1, "released": 0, "retained": [0]}
    b.request_read("r1", 0, 2)  # epoch 1 is not complete: the read waits
    assert b.answer_reads() == [] and b.reads_waiting
    b.request_read("r0", 0, 1)
    [(reader, batches, reply)] = b.answer_reads()
    assert reader == "r0" and reply == {"ok": True, "rows": 3, "batches": 2}
    assert rows_of(b, batches) == [(0, (1, "a")), (0, (2, "b")), (0, (4, "d"))]
    b.advance(None)  # the input is complete
    assert b.complete_before() == 2
    [(reader, batches, reply)] = b.answer_reads()
    assert reader == "r1" and reply["rows"] == 4 and not b.reads_waiting
    assert rows_of(b, batches)[-1] == (1, (3, "c"))


def test_released_epochs_are_forgotten_and_cannot_be_read_again():
    b = SinkBuffer("out", FIELDS, False, 2)
    for t in range(3):
        b.add(t, [(t, str(t))])
    b.advance(3)
    b.release(2)
    b.release(1)  # releases never move back
    assert b.released == 2 and sorted(b.complete) == [2] and not b.drained
    b.request_read("r", 1, 3)
    [(_, batches, reply)] = b.answer_reads()
    assert batches == [] and not reply["ok"]
    assert "epochs before 2 were already released by a reader commit on worker 2" in reply["error"]
    b.release(3)
    assert b.drained


def test_a_stopping_bridge_fails_reads_it_cannot_complete_and_a_done_sink_answers_all():
    b = SinkBuffer("out", FIELDS, False, 0)
    b.add(0, [(1, "a")])
    b.advance(1)
    b.request_read("complete", 0, 1)
    b.request_read("incomplete", 0, 5)
    answers = {reader: reply for reader, _, reply in b.answer_reads(stopping="bye")}
    assert answers["complete"]["ok"] and answers["incomplete"] == {"ok": False, "kind": "stopping", "error": "bye"}
    b.request_read("late", 0, 5)
    b.done = True  # nothing more will come: answer with what there is
    [(_, batches, reply)] = b.answer_reads(stopping="bye")
    assert reply == {"ok": True, "rows": 1, "batches": 1} and len(batches) == 1


def test_empty_epochs_complete_without_batches():
    b = SinkBuffer("out", FIELDS, False, 0)
    b.add(4, [])
    b.advance(None)
    assert b.complete_before() == 5 and b.complete == {} and b.drained
    assert b.status()["empty"] and b.status()["max_seen"] == 4


def test_arrow_records_are_conformed_to_the_schema():
    b = SinkBuffer("out", FIELDS, True, 0)
    table = pa.table({"key": pa.array([1, 2], pa.int32()), "name": ["x", "y"]})
    b.add(0, [table, pa.RecordBatch.from_pylist([], schema=b.schema)])
    b.advance(1)
    assert [n for n, _ in b.complete[0]] == [2]  # the empty batch is skipped
    with pytest.raises(BridgeError, match=r"sink 'out' \(arrow=True\): records must be pyarrow RecordBatch"):
        b.add(1, [(1, "a")])


def test_records_that_do_not_fit_name_the_record_or_the_column():
    b = SinkBuffer("out", FIELDS, False, 0)
    with pytest.raises(BridgeError, match=r"record \(1,\) at epoch 3 does not have the 2 fields"):
        b.add(3, [(1, "a"), (1,)])
    with pytest.raises(BridgeError, match=r"column 'key' \(bigint\) at epoch 0"):
        b.add(0, [("one", "a")])
