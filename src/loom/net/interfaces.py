"""Which network interface holds an address: how loom binds gloo and its own listeners to the network a job
uses and nowhere else."""

from __future__ import annotations

import socket

__all__ = ["interface_of"]


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 ``address`` on this host (Linux), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None
