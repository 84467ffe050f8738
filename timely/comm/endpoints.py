"""Worker addresses: ipc paths on one host, tcp ports from a hostfile across hosts.

Each worker listens on one endpoint (its ``ROUTER`` socket). With a hostfile, host ``h`` (line
``h``, ``host[:baseport]``) runs ``workers_per_host`` workers; its local worker ``l`` has the global
index ``h * workers_per_host + l`` and listens on ``tcp://host:(baseport + l)``.
"""
from __future__ import annotations

import errno
import os
import socket

from .errors import HostfileError

#: Default first port of a host (timely's default is 2101 too).
DEFAULT_PORT = 2101

#: Longest path a Unix-domain socket address can hold on Linux (``sun_path`` minus the NUL).
IPC_PATH_MAX = 107


def ipc_endpoints(directory: str, peers: int) -> list[str]:
    """Return one ``ipc://`` endpoint per worker inside ``directory`` (one host only)."""
    paths = [os.path.join(directory, f"w{i}") for i in range(peers)]
    if paths and len(paths[-1]) > IPC_PATH_MAX:
        raise ValueError(f"ipc path {paths[-1]!r} is longer than {IPC_PATH_MAX} bytes; use a shorter directory")
    return [f"ipc://{p}" for p in paths]


def loopback_endpoints(base_port: int, peers: int) -> list[str]:
    """Return ``tcp://127.0.0.1:base_port+i`` for each worker ``i`` (one host only)."""
    return [f"tcp://127.0.0.1:{base_port + i}" for i in range(peers)]


def parse_hostfile(text: str, default_port: int = DEFAULT_PORT, source: str = "hostfile",
                   workers: int = 1) -> list[tuple[str, int]]:
    """Parse ``host[:baseport]`` lines (``[ipv6]`` or ``[ipv6]:baseport``; blank lines and ``#``
    comments ignored) into pairs; a host's ``workers`` listen on ``baseport`` and the ports after it."""
    hosts: list[tuple[str, int]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("["):  # [ipv6] or [ipv6]:port
            host, bracket, rest = line[1:].partition("]")
            if not bracket or rest and not rest.startswith(":"):
                raise HostfileError(f"{source}:{number}: expected [address] or [address]:port, got {line!r}")
            port_text = rest[1:] if rest else None
        elif line.count(":") > 1:
            raise HostfileError(f"{source}:{number}: an IPv6 address needs brackets, [address] or "
                                f"[address]:port, got {line!r}")
        else:
            host, sep, port_text = line.partition(":")
            port_text = port_text if sep else None
        if port_text is None:
            port = default_port
        else:
            try:
                port = int(port_text)
            except ValueError:
                raise HostfileError(f"{source}:{number}: bad port {port_text!r} in {line!r}") from None
        if not host or any(c.isspace() for c in host):
            raise HostfileError(f"{source}:{number}: expected host[:port], got {line!r}")
        if not 0 < port <= 65536 - workers:
            raise HostfileError(f"{source}:{number}: its {workers} worker(s) would listen on ports {port} to "
                                f"{port + workers - 1}, which must lie within 1-65535 ({line!r})")
        hosts.append((host, port))
    if not hosts:
        raise HostfileError(f"{source}: no hosts listed")
    return hosts


def hostfile_endpoints(hosts: list[tuple[str, int]], workers_per_host: int) -> list[str]:
    """Return the tcp endpoint of every worker, by global index (host-major)."""
    out: list[str] = []
    for host, base in hosts:
        h = f"[{host}]" if ":" in host else host
        out.extend(f"tcp://{h}:{base + local}" for local in range(workers_per_host))
    return out


def free_loopback_ports(count: int) -> list[int]:
    """Return ``count`` tcp ports on 127.0.0.1 that were free a moment ago (racy; for tests)."""
    socks, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def ipc_path_in_use(path: str) -> bool:
    """True if a live process listens on the Unix socket ``path``; removes a stale socket file.

    ZeroMQ silently replaces an existing ipc socket file on bind, which would let a second job
    steal a running job's address; checking first turns that into a clear error.
    """
    if not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            try:
                os.unlink(path)  # stale: its listener died without cleaning up
            except FileNotFoundError:
                pass
            return False
        return True
    finally:
        probe.close()
