"""Process bookkeeping shared by the multi-process tests: find, reap and kill leftover children."""
from __future__ import annotations

import ctypes
import os

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make this process the parent of orphaned descendants, so a test can find and reap them."""
    ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


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


def reap_zombies(exclude: set[int]) -> None:
    """Collect the exit status of every finished child not in ``exclude``."""
    for pid, _ in children(os.getpid()):
        if pid in exclude:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
