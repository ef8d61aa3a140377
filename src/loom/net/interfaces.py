"""Which network interface holds an address, and which local address routes to a host: how loom binds gloo and
its own listeners to the network a job uses and nowhere else."""

from __future__ import annotations

import socket

__all__ = ["interface_address", "interface_of", "route_address"]


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` on this host (Linux), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            return socket.inet_ntoa(
                fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))[20:24]
            )
        except OSError:
            return None


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 ``address`` on this host (Linux), or None."""
    return next((name for _, name in socket.if_nameindex() if interface_address(name) == address), None)


def route_address(host: str, port: int = 9) -> str:
    """This host's address on the route to ``host`` (IPv4 or IPv6): what a server there sees as this host's
    address (barring NAT). A UDP "connect" sends nothing, it only picks the route; raises OSError where there
    is none."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
