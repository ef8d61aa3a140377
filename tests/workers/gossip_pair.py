"""Two gossip workers, learning stopped (lr 0): exact pairwise averages, a refused intruder, a rejoining peer.

1. Each rank starts from its own parameters (``same_start=False``) and takes 5 steps while every collective of
   torch.distributed raises: both end with exactly (a + b) / 2 (the test computes it from the printed initial
   values).
2. Rank 1 knocks on rank 0's listener with a wrong job secret (once through the real handshake, once with a raw
   hello, a bogus proof and a whole EXCHANGE frame behind it): both are refused, nothing is served or changed.
3. Rank 1 "restarts": it closes its job and sets up a fresh model (all 7.0) under the same store, so it joins the
   running job and must copy rank 0's parameters; then both take 3 more steps.

Prints one JSON line per rank. Run by tests/test_gossip.py.
"""

import json
import os
import socket
import time

import torch.distributed as dist
from gossip_common import NoCollectives, build, dataset, flat
from torch import nn

import loom
from loom.comm import counters
from loom.comm.peer_wire import EXCHANGE, header
from loom.net.handshake import HandshakeRefused, dial_handshake
from loom.parallel.gossip.gossip import Gossip


def train(job, steps, data):
    loader = job.loader(data, global_batch_size=8, seed=3)
    losses = []
    with NoCollectives():
        while len(losses) < steps:
            for batch in loader:
                losses.append(job.train_step(batch))
                if len(losses) == steps:
                    break
    return losses


topo = loom.init()
data = dataset()
model, opt = build(topo.rank)
initial = flat(model).tolist()
job = Gossip(peers="ring", same_start=False, deadline_s=20.0).setup(model, opt, nn.functional.mse_loss)
losses = train(job, 5, data)
dist.barrier()  # both done: every exchange of phase 1 is applied
with job.paused():
    after_pair = flat(model).tolist()
stats_pair = job.comm_stats()

# -- 2. an intruder with the wrong secret ----------------------------------------------------------------------
intruder = {}
if topo.rank == 1:
    host, port = job.directory.address_of(0, False).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            dial_handshake(sock, b"w" * 32, (1).to_bytes(4, "big") + (0).to_bytes(4, "big"),
                           time.monotonic() + 10, b"LOOMGSP1", b"gossip")  # fmt: skip
            intruder["handshake"] = "accepted"
        except HandshakeRefused as refused:
            intruder["handshake"] = str(refused)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        hello = b"LOOMGSP1" + os.urandom(16) + (1).to_bytes(4, "big") + (0).to_bytes(4, "big")
        frame = header(EXCHANGE, 1, 1, job.layout.fingerprint, job.layout.nbytes)
        sock.sendall(hello + b"p" * 32 + frame + bytes(job.layout.nbytes))
        sock.settimeout(10)
        received, closed = b"", "eof"
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except ConnectionResetError:  # closed with our unread frame in its buffer
            closed = "reset"
        intruder["raw_reply_bytes"] = len(received)  # the listener's challenge (48), then it closed
        intruder["raw_closed"] = closed
dist.barrier()
if topo.rank == 0:
    until = time.monotonic() + 10
    while job.comm_stats()["rejected"] < 2 and time.monotonic() < until:
        time.sleep(0.05)
with job.paused():
    after_intruder = flat(model).tolist()
stats_intruder = job.comm_stats()
dist.barrier()  # rank 0's snapshot is taken before rank 1 rejoins: rank 0 serving its COPY counts as served

# -- 3. rank 1 restarts and joins ------------------------------------------------------------------------------
joined = None
if topo.rank == 1:
    job.close()
    model, opt = build(1, fill=7.0)
    job = Gossip(peers="ring", same_start=False, deadline_s=20.0).setup(model, opt, nn.functional.mse_loss)
    joined = {"from": job.joined_from, "params": flat(model).tolist()}
dist.barrier()
losses += train(job, 3, data)
dist.barrier()
with job.paused():
    final = flat(model).tolist()
stats = job.comm_stats()
job.close()
print(json.dumps({
    "rank": topo.rank, "initial": initial, "after_pair": after_pair, "stats_pair": stats_pair,
    "intruder": intruder, "after_intruder": after_intruder, "stats_intruder": stats_intruder,
    "joined": joined, "final": final, "stats": stats, "losses": losses,
    "ops": counters().snapshot()["ops"], "payload_bytes": job.layout.nbytes,
}), flush=True)  # fmt: skip
