"""Several "hosts" on one machine: network namespaces joined by a bridge, for multi-host launcher tests.

Each host is a namespace with one veth link (``10.<subnet>.0.<i+1>/24``) whose peer is a port of a bridge living
in a namespace of its own, so any number of hosts reach each other and nothing on them is reachable from the
machine's own network (nor the machine's loopback from them). Needs root and iproute2; `can_make_namespaces`
tries once, so tests skip cleanly where either is missing (a container without CAP_SYS_ADMIN, say).
"""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

__all__ = ["NamespaceHost", "bridged_hosts", "can_make_namespaces"]

_count = itertools.count()


@dataclass(frozen=True)
class NamespaceHost:
    name: str
    """The namespace (``ip netns exec NAME ...``)."""
    address: str
    interface: str
    """The host's veth link, which holds ``address`` (what ``GLOO_SOCKET_IFNAME`` names there)."""

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this host's namespace, as a host of its own: ``LOOM_HOST_ID`` set (namespaces of one
        machine share its host name and boot id, so loom would see one host and let its shared-memory algorithms
        bypass the network between them)."""
        return ["ip", "netns", "exec", self.name, "env", f"LOOM_HOST_ID=netns-{self.name}", *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@functools.cache
def can_make_namespaces() -> bool:
    """True when this process may create network namespaces (root, iproute2, and the kernel lets it)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"loomprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return False
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return True


def _kill_namespace(name: str) -> None:
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10).stdout
    for pid in pids.split():
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


@contextmanager
def bridged_hosts(count: int, subnet: int = 78) -> Iterator[list[NamespaceHost]]:
    """``count`` namespace hosts on one bridge, removed afterwards with every process still inside them."""
    tag = f"{os.getpid() % 100000}{next(_count)}"
    bridge = f"lbr{tag}"
    hosts = [NamespaceHost(f"lh{tag}n{i}", f"10.{subnet}.0.{i + 1}", f"lv{tag}n{i}") for i in range(count)]
    made: list[str] = []
    try:
        _ip("netns", "add", bridge)
        made.append(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            _ip("netns", "add", host.name)
            made.append(host.name)
            port = f"lp{tag}n{i}"
            _ip("link", "add", host.interface, "type", "veth", "peer", "name", port)
            _ip("link", "set", host.interface, "netns", host.name)
            _ip("link", "set", port, "netns", bridge)
            _ip("-n", bridge, "link", "set", port, "master", "br0")
            _ip("-n", bridge, "link", "set", port, "up")
            _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.name, "link", "set", host.interface, "up")
            _ip("-n", host.name, "link", "set", "lo", "up")
        yield hosts
    finally:
        for name in reversed(made):
            _kill_namespace(name)
