"""Separate "hosts" for tests: Linux network namespaces joined by veth links to a bridge.

:class:`Network` creates one namespace per host and one switch namespace holding a bridge; host
``h`` has the interface ``eth0`` with the address ``10.213.0.(h+1)/24``, whose veth peer ``p<h>`` is
a port of the bridge. Every interface and address is created inside namespaces this module creates
(``ip link add ... netns``), never on the machine's own interfaces, and :meth:`Network.close`
deletes the namespaces (with their links). Namespace names carry this process's id and a random
tag, so that parallel runs do not collide; :func:`remove_stale` deletes those left by runs whose
process is gone (an aborted run).
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Sequence

#: Prefix of every namespace this module creates: ``tdh<pid>x<tag>-<role>``.
PREFIX = "tdh"
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")
SUBNET = "10.213.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be created here (not root, no ``ip``, no permission), else ``None``."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Delete the namespaces of this module whose creating process no longer exists."""
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)


class Network:
    """``hosts`` namespaces on one bridge; use as a context manager (or call :meth:`close`)."""

    def __init__(self, hosts: int) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"1 to 250 hosts, not {hosts}")
        tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.switch = f"{tag}-sw"
        self.names = [f"{tag}-h{h}" for h in range(hosts)]
        #: Host ``h``'s address (on its ``eth0``).
        self.addresses = [f"{SUBNET}.{h + 1}" for h in range(hosts)]
        self._made: list[str] = []  # namespaces to delete, in creation order
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in (self.switch, *self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h, ns in enumerate(self.names):
            # Both ends are created directly in their namespaces: nothing appears in the machine's own.
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{h}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{h}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{h}", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def delay(self, ms: float, jitter_ms: float) -> str | None:
        """Add ``tc netem`` delay (with jitter) on every host's ``eth0``; return why it could not
        (e.g. the kernel has no netem qdisc), else ``None``."""
        for ns in self.names:
            r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem",
                                "delay", f"{ms}ms", f"{jitter_ms}ms"], capture_output=True, text=True, timeout=20)
            if r.returncode != 0:
                return f"tc netem delay unavailable: {(r.stderr or r.stdout).strip()}"
        return None

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def cut(self, host: int) -> None:
        """Take host ``host``'s bridge port down: its packets are dropped silently, both ways."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def close(self) -> None:
        """Delete every namespace created (their links go with them). Processes still running in
        one keep it alive: stop them first."""
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
