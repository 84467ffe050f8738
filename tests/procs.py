"""Process bookkeeping shared by the multi-process tests: find, reap and kill leftover children."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make this process the parent of orphaned descendants, so a test can find and reap them."""
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def alive(pid: int) -> bool:
    """True if ``pid`` runs (an exited orphan is our zombie until reaped: not alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of every process whose parent is ``pid`` (from /proc; zombies included)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append((int(entry), fields[0]))
    return out


def new_children(before: set[int]) -> list[tuple[int, str]]:
    """(pid, state) of this process's children whose pids are not in ``before`` (zombies included)."""
    return [c for c in children(os.getpid()) if c[0] not in before]


def reap_zombies(exclude: set[int]) -> None:
    """Collect the exit status of every finished child not in ``exclude``."""
    for pid, _ in children(os.getpid()):
        if pid in exclude:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def kill_leftovers(before: set[int], wait: float = 5.0) -> list[tuple[int, str]]:
    """Give the live children not in ``before`` ``wait`` seconds to exit, then SIGKILL them; reap
    every finished one. Return those that were still alive after the wait."""
    deadline = time.monotonic() + wait
    reap_zombies(before)
    left = [c for c in children(os.getpid()) if c[1] != "Z" and c[0] not in before]
    while left and time.monotonic() < deadline:  # give exiting processes a moment
        time.sleep(0.05)
        reap_zombies(before)
        left = [c for c in children(os.getpid()) if c[1] != "Z" and c[0] not in before]
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        time.sleep(0.1)
    reap_zombies(before)
    return left


@contextlib.contextmanager
def no_leftover_children() -> Iterator[None]:
    """Make this process the reaper of orphans; on exit kill and reap every child started inside
    the block (orphaned grandchildren included) and fail if any was still running."""
    become_subreaper()
    # multiprocessing's resource tracker: spawn starts it once and keeps it for this process's life.
    resource_tracker.ensure_running()
    before = {pid for pid, _ in children(os.getpid())}  # not ours: e.g. other fixtures' servers, the tracker
    yield
    left = kill_leftovers(before)
    assert not left, f"processes left behind: {left}"
