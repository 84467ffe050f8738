"""A timely job fed by Spark: ``python -m timely.launch -w 2 examples/spark_pipeline.py COORDINATOR [options]``.

Spark writes ``(key bigint, value bigint)`` rows to the source ``events`` (one epoch per Spark
write or micro-batch); the job counts rows per key and serves the counts as the sink ``counts``
(``key bigint, count bigint``) for Spark to read back. See ``examples/spark_demo.py`` for the Spark
side.

Options (after the coordinator endpoint, which every worker must be given):

- ``--megaphone``: count with a Megaphone migratable operator (cumulative count per key, emitted at
  every epoch in which the key occurs) and, once the first epoch is complete, migrate half of the
  bins to the other workers while data keeps flowing. Without it: ``count_by_key`` (per-epoch
  counts).
- ``--k K`` (2^K Megaphone bins, default 4), ``--strategy`` (``batched``, ``fluid``,
  ``all_at_once``).
- ``--capture DIR``: each worker writes the rows its source emitted, per epoch, to
  ``DIR/worker-<index>.json`` when the job ends (for exactly-once checks).

The job runs until Spark calls ``spark_bridge.shutdown(COORDINATOR)``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import spark_bridge
import timely

SCHEMA = "key bigint, value bigint"


def _args(argv):
    p = argparse.ArgumentParser(prog="spark_pipeline.py")
    p.add_argument("coordinator", nargs="?", default=os.environ.get("TIMELY_SPARK_COORDINATOR"))
    p.add_argument("--megaphone", action="store_true")
    p.add_argument("--k", type=int, default=4, help="2^k Megaphone bins")
    p.add_argument("--strategy", default="batched")
    p.add_argument("--capture")
    return p.parse_args(argv)


def _count_fold(time, records, timers, state, notificator):
    """Megaphone per-bin logic: cumulative count per key, emitted for the keys seen at ``time``."""
    touched = {}
    for key, _value in records:
        n = state.get(key, 0) + 1
        state[key] = n
        touched[key] = n
    return list(touched.items())


def half_swapped(table, peers):
    """A routing table in which the first half of the bins changed owner."""
    half = len(table) // 2
    return tuple(((w + 1) % peers) if b < half else w for b, w in enumerate(table))


def main(worker: timely.Worker):
    args = _args(worker.args)
    with worker.dataflow() as scope:
        events = spark_bridge.source(scope, "events", SCHEMA, coordinator=args.coordinator)
        captured = events.capture() if args.capture else None
        if args.megaphone:
            import megaphone

            ev_probe = events.probe()
            control = megaphone.ControlInput(scope, k=args.k)
            counts = megaphone.unary(events, control, 0, _count_fold, name="KeyedCount")
            out = counts.stream
        else:
            out = events.count_by_key(0)
        spark_bridge.sink(out, "counts", "key bigint, count bigint")

    migrated = None
    if args.megaphone:
        controller = megaphone.Controller(control, counts.probe) if worker.index == 0 else None
        # Keep the control input in step with the source's epochs (Megaphone's F holds a record at t
        # until the control frontier passes t); after epoch 0 is complete, migrate half the bins.
        while worker.has_dataflows():
            frontier = ev_probe.frontier.elements()
            if not frontier:
                if not control.handle.closed:
                    control.close()
            elif frontier[0] > control.time:
                control.advance_to(frontier[0])
            if controller is not None:
                if migrated is None and frontier and frontier[0] >= 1 and worker.peers > 1:
                    migrated = controller.rebalance(half_swapped(controller.current_table, worker.peers),
                                                    args.strategy)
                if not control.handle.closed:
                    controller.tick()
            worker.step_or_park(0.01)
    worker.finish()
    summary: dict[str, Any] = {"worker": worker.index}
    if args.megaphone:
        summary["migration_events"] = len(counts.events)
        summary["owned_bins"] = counts.owned_bins()
        # One write per line, so the lines of concurrent workers do not interleave.
        sys.stdout.write(f"worker {worker.index}: {len(counts.events)} migration events, owns bins "
                         f"{counts.owned_bins()}\n")
        sys.stdout.flush()
    if captured is not None:
        batches = captured.extract()
        with open(os.path.join(args.capture, f"worker-{worker.index}.json"), "w") as f:
            json.dump({"worker": worker.index, "epochs": [[t, [list(r) for r in recs]] for t, recs in batches],
                       **summary}, f)
    return summary
