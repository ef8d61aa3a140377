"""Every listening TCP socket of a set of processes, read from /proc (as ``ss -ltnp`` does, without needing it).

`listeners(pids)` maps each socket inode in LISTEN state (/proc/net/tcp and tcp6 of this network namespace) to
its local address, and each process's open descriptors (``/proc/PID/fd`` -> ``socket:[INODE]``) to those inodes.
`loopback_job(out_dir, root_pid, ray_session)` is a training function for `loom.spark.run` / `loom.ray.run`: it
joins the job, trains one DataParallel step (gloo and loom's own links are then up), lists the listeners of every
process below ``root_pid`` (the test: the Spark JVM, its Python workers and loom's; Ray's GCS, raylets and
actors), of this rank and its parent (the Spark task or Ray actor that hosts the store for rank 0) and of Ray's
session, writes them to ``OUT_DIR/rank{R}.json`` and waits at a barrier, so every rank lists while every other is
alive.

Used by tests/test_loopback.py.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
from pathlib import Path

_LISTEN = "0A"


def _address(hex_addr: str, family: int) -> str:
    raw = bytes.fromhex(hex_addr)
    if family == socket.AF_INET:
        return socket.inet_ntop(family, struct.pack("<I", struct.unpack(">I", raw)[0]))
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i : i + 4])[0]) for i in range(0, 16, 4))
    mapped = ipaddress.IPv6Address(words).ipv4_mapped  # a Java socket on ::ffff:127.0.0.1 is IPv4 loopback
    return str(mapped) if mapped is not None else socket.inet_ntop(family, words)


def _listening_inodes() -> dict[str, tuple[str, int]]:
    found = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            addr, port = fields[1].split(":")
            found[fields[9]] = (_address(addr, family), int(port, 16))
    return found


def listeners(pids) -> list[dict]:
    """``[{"pid", "command", "address", "port"}]`` for every listening TCP socket the processes ``pids`` hold."""
    inodes = _listening_inodes()
    out = []
    for pid in sorted(set(pids)):
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
            command = (
                Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            )
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                address, port = inodes[target[8:-1]]
                out.append({"pid": pid, "command": command, "address": address, "port": port})
    return out


def descendants(root: int) -> set[int]:
    """``root`` and every live process below it (parent links from ``/proc/PID/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def loopback_job(out_dir: str, root_pid: int, ray_session: str | None = None) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn

    import loom

    topo = loom.init()
    model = nn.Linear(4, 1)
    job = loom.DataParallel().setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss
    )
    job.train_step((torch.ones(2, 4), torch.ones(2, 1)))
    pids = descendants(root_pid) | {os.getpid(), os.getppid()}
    if ray_session is not None:  # Ray's own processes, even where one has left the driver's tree
        from loom.ray.local import session_processes

        pids |= set(session_processes(ray_session))
    found = listeners(pids)
    Path(out_dir, f"rank{topo.rank}.json").write_text(json.dumps(found))
    dist.barrier()  # nobody leaves (closing its listeners) before every rank has listed its own
    return topo.rank
