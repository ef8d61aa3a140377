"""``python -m loom_bench.small_message_cpu``: the CPU time of one small shared-memory message, in one process.

A `loom.comm.shm_channel.ShmSender` and `ShmReceiver` on the two ends of one `loom.comm.shm_ring.Ring`, both in
this process: each call sends a ``--bytes`` float32 message and receives it (``send``, the handle's ``wait``,
``recv``: the Python work of both ends of one message, with no peer to wait for). Timed with
``time.thread_time`` (this thread's CPU time, which a preemption by another process does not inflate, unlike the
wall clock on a shared machine); prints, as JSON, the fastest of ``--repeats`` means of ``--calls`` calls, in µs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from loom.comm.shm_channel import ShmReceiver, ShmSender
from loom.comm.shm_ring import Ring

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    ring = Ring.create(1 << 20)
    reader = Ring.attach(ring.name, 1 << 20)  # removes the name: the memory goes with this process
    sender, receiver = ShmSender(ring, 0, 1), ShmReceiver(reader, 1, 0)
    message = [torch.randn(args.bytes // 4)]

    def one() -> None:
        for handle, _ in sender.send(message):
            handle.wait()
        receiver.recv()

    for _ in range(500):
        one()
    means = []
    for _ in range(args.repeats):
        start = time.thread_time()
        for _ in range(args.calls):
            one()
        means.append((time.thread_time() - start) / args.calls * 1e6)
    print(json.dumps({"bytes": args.bytes, "us": min(means), "means": means}))


if __name__ == "__main__":
    main()
