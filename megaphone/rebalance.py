"""Rebalance a running Megaphone job from outside: ``python -m megaphone.rebalance``.

Talks to a :class:`megaphone.endpoint.ControlEndpoint`::

    python -m megaphone.rebalance --endpoint tcp://127.0.0.1:5555 --balanced
    python -m megaphone.rebalance --endpoint tcp://127.0.0.1:5555 --table 0,1,0,1 --strategy fluid
    python -m megaphone.rebalance --endpoint tcp://127.0.0.1:5555 --move 3:1 --move 7:0
    python -m megaphone.rebalance --endpoint tcp://127.0.0.1:5555 --status

After a rebalance request it polls the job and prints one line per completed step (bins moved,
duration) until the migration completes; with tqdm installed it also shows a progress bar.

Exit status: 0 on success, 1 if the job rejected the request, 2 for bad arguments, 3 if the
endpoint could not be reached or did not answer within ``--timeout`` seconds, 4 if the migration
followed was abandoned: the job closed its control input before issuing some of its steps (they
never run; the steps issued before completed).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from timely.comm.secret import JobSecret, SecretError, resolve

from .endpoint import EndpointError, RequestError, call
from .plan import STRATEGIES

EXIT_REJECTED = 1  # the job answered with an error (RequestError)
EXIT_UNREACHABLE = 3  # no answer in time, or no connection (EndpointError)
EXIT_ABANDONED = 4  # the control input closed before every step of the migration was issued


def _table(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",")]  # (an empty entry is an error, not skipped)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--table expects comma-separated worker indices, not {text!r}") from None


def _move(text: str) -> tuple[int, int]:
    try:
        b, w = text.split(":")
        return int(b), int(w)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--move expects BIN:WORKER, not {text!r}") from None


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds (``--timeout``, ``--interval``): a
    negative timeout would make the poll for an answer wait forever, and so would ``nan``/``inf``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, not {text!r}")
    return value


def _conflicting_move(moves: Sequence[tuple[int, int]]) -> str | None:
    """The error for ``--move`` options that move one bin to two different workers, if any (the
    same move twice is harmless)."""
    target: dict[int, int] = {}
    for b, w in moves:
        if target.setdefault(b, w) != w:
            return f"bin {b} is moved to both worker {target[b]} and worker {w}"
    return None


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m megaphone.rebalance``."""
    p = argparse.ArgumentParser(prog="python -m megaphone.rebalance",
                                description="Rebalance a running Megaphone job through its control endpoint.",
                                epilog="Exit status: 0 on success, 1 if the job rejected the request, 2 for bad "
                                       "arguments, 3 if the endpoint could not be reached or did not answer in time, "
                                       "4 if the job closed its control input before issuing every step of the "
                                       "migration (the steps not issued never run).")
    p.add_argument("--endpoint", required=True, help="the job's control endpoint, e.g. tcp://127.0.0.1:5555")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--table", type=_table, help="target routing table: one worker per bin, comma-separated")
    what.add_argument("--balanced", action="store_true", help="target the round-robin table")
    what.add_argument("--move", type=_move, action="append", metavar="BIN:WORKER", help="move one bin (repeatable)")
    p.add_argument("--strategy", default="batched", choices=STRATEGIES,
                   help="migration strategy (default: batched)")
    p.add_argument("--status", action="store_true",
                   help="print the routing table and migration status (after the migration, if one is requested)")
    p.add_argument("--timeout", type=_seconds, default=5.0,
                   help="seconds to wait for each answer (default 5)")
    p.add_argument("--no-wait", action="store_true", help="submit the request and exit without following it")
    p.add_argument("--interval", type=_seconds, default=0.1,
                   help="seconds between status polls (default 0.1)")
    p.add_argument("--secret-file", metavar="FILE",
                   help="the job secret, if the job has one (default: $TIMELY_SECRET, then $TIMELY_SECRET_FILE)")
    return p


def _fmt_bins(bins: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, bins[:limit]))
    return f"[{shown}{', ...' if len(bins) > limit else ''}]"


def _print_status(endpoint: str, timeout: float, out: Any, secret: JobSecret | None = None) -> None:
    t = call(endpoint, {"op": "table"}, timeout, secret)
    s = call(endpoint, {"op": "status"}, timeout, secret)
    print(f"table ({t['nbins']} bins, {t['peers']} workers): {','.join(map(str, t['table']))}", file=out)
    if "routing_table" in t:
        print(f"operator routing table: {','.join(map(str, t['routing_table']))}", file=out)
    print(f"control time {s['control_time']}; {s.get('completed_total', s['completed_count'])} steps completed, "
          f"{len(s['in_flight'])} in flight, {len(s.get('copying', ()))} copying ahead, {s['queued_count']} queued",
          file=out)
    for ev in s["in_flight"]:
        print(f"  in flight: migration {ev['migration']} step {ev['index'] + 1}/{ev['steps']}, "
              f"bins {_fmt_bins(ev['bins'])}, {ev.get('elapsed', 0.0) * 1000:.1f} ms so far", file=out)


def follow(endpoint: str, migration: int, total: int, timeout: float, interval: float, out: Any,
           secret: JobSecret | None = None) -> int:
    """Poll the status of ``migration`` and print each step as it completes, until every step has
    completed or was abandoned (the control input closed before it was issued); return the number
    of steps abandoned (0: the migration completed)."""
    bar = None
    try:
        from tqdm import tqdm  # optional

        if total and out is sys.stdout and sys.stderr.isatty():
            bar = tqdm(total=total, unit="step", desc="migrating")
    except ImportError:
        pass
    seen = 0
    abandoned = 0
    first: float | None = None
    last: float | None = None
    try:
        while True:
            s = call(endpoint, {"op": "status", "migration": migration, "since": seen}, timeout, secret)
            for ev in s["completed"]:
                first = ev["issued_at"] if first is None else min(first, ev["issued_at"])
                last = ev["completed_at"] if last is None else max(last, ev["completed_at"])
                line = (f"step {ev['index'] + 1}/{ev['steps']}: {len(ev['bins'])} bins {_fmt_bins(ev['bins'])} "
                        f"at time {ev['issue_time']}, {ev['duration'] * 1000:.1f} ms")
                if bar is not None:
                    bar.write(line)
                    bar.update(1)
                else:
                    print(line, file=out, flush=True)
            seen += len(s["completed"])
            if s.get("trimmed"):  # completed, and dropped from the controller's bounded log meanwhile
                # (never one with abandoned steps: they are newer than the step in flight at the
                # close, and the log keeps the migration of the step that completed last and later)
                print(f"migration {migration}: its remaining steps are no longer in the controller's log "
                      "(it keeps the newest migrations); it has completed", file=out)
                break
            if s["done"] and seen >= s["completed_count"]:
                abandoned = int(s.get("abandoned_count", 0))
                break
            if seen >= s["completed_count"]:
                time.sleep(interval)
    finally:
        if bar is not None:
            bar.close()
    took = f" in {last - first:.3f} s" if first is not None and last is not None else ""
    if abandoned:
        print(f"migration {migration} abandoned: {abandoned} of {total} steps were never issued (the job closed "
              f"its control input first); {seen} completed{took}", file=out)
    else:
        print(f"migration {migration} complete: {total} steps{took}", file=out)
    return abandoned


def main(argv: Sequence[str] | None = None, out: Any = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``), printing to ``out`` (default:
    stdout); return the exit status."""
    out = out or sys.stdout
    cli = parser()
    args = cli.parse_args(argv)
    req: dict[str, Any] = {"op": "rebalance", "strategy": args.strategy}
    if args.table is not None:
        req["table"] = args.table
    elif args.balanced:
        req["balanced"] = True
    elif args.move:
        conflict = _conflicting_move(args.move)
        if conflict is not None:
            cli.error(f"--move: {conflict}")  # exits with status 2
        req["moves"] = [list(m) for m in args.move]
    else:
        req = {}
    try:
        secret = resolve(None, args.secret_file)
    except SecretError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if not req:
            if not args.status:
                cli.error("give --table, --balanced, --move or --status")
            _print_status(args.endpoint, args.timeout, out, secret)
            return 0
        reply = call(args.endpoint, req, args.timeout, secret)
        mid, steps = reply["migration"], reply["steps"]
        if not steps:
            print(f"migration {mid}: nothing to move (the table is already the target)", file=out, flush=True)
        else:
            print(f"migration {mid}: {reply['moves']} bins in {steps} steps ({reply['strategy']})", file=out, flush=True)
        abandoned = 0
        if steps and not args.no_wait:
            abandoned = follow(args.endpoint, mid, steps, args.timeout, args.interval, out, secret)
        if args.status:
            _print_status(args.endpoint, args.timeout, out, secret)
        if abandoned:
            print(f"error: migration {mid}: {abandoned} of {steps} steps abandoned: the job closed its control "
                  "input before issuing them", file=sys.stderr)
            return EXIT_ABANDONED
        return 0
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REJECTED
    except EndpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
