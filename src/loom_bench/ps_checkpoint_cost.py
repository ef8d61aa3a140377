"""Benchmark: what the parameter servers' default checkpoints cost, against the same steps with them off.

``python -m loom_bench.ps_checkpoint_cost [--steps 200] [--reps 3]`` starts one server (with a checkpoint folder, as
under ``loom run``) and trains from this process, one worker, on two models: the 8-value least-squares model of the
fault tests and a 1M-parameter MLP (SGD with momentum: 8 MB per save). Per model and mode (``sync``: a save per
step, before its reply; ``async``: by time, ``checkpoint_interval_s=1``) it times ``--steps`` steps with the
defaults and with checkpoints off (``checkpoint_every=0, checkpoint_interval_s=0``), alternating, ``--reps``
times, and prints the median seconds per step and the ratio on / off. Each run is its own model (namespace) on
the server. Figures depend on the machine's load and disk; print them with their command.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _models():
    import torch
    from torch import nn

    def tiny():
        torch.manual_seed(0)
        model = nn.Linear(8, 1, bias=False)
        return model, (torch.randn(48, 8), torch.randn(48, 1))

    def mlp():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 512))
        return model, (torch.randn(8, 512), torch.randn(8, 512))

    return {"tiny (8 values)": tiny, "mlp (1.05M values)": mlp}


def _time_steps(build, mode: str, on: bool, steps: int, address: str, secret: str, namespace: str) -> float:
    import torch
    from torch import nn

    from loom.parallel.ps.parameter_server import ParameterServer
    from loom.topology import Topology

    model, batch = build()
    options: dict[str, Any] = {} if on else {"checkpoint_every": 0, "checkpoint_interval_s": 0.0}
    job = ParameterServer(
        topology=Topology(0, 1, 0, 1, "none"), addresses=(address,), secret=secret, namespace=namespace,
        mode=mode, **options,
    ).setup(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), nn.functional.mse_loss)  # fmt: skip
    for _ in range(3):  # warm-up
        job.train_step(batch)
    started = time.perf_counter()
    for _ in range(steps):
        job.train_step(batch)
    elapsed = time.perf_counter() - started
    job.close()
    return elapsed / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    secret, address = secrets.token_hex(32), f"127.0.0.1:{_free_port()}"
    folder = tempfile.TemporaryDirectory(prefix="loom-ps-cost-")
    env = dict(os.environ, LOOM_JOB_SECRET=secret, OMP_NUM_THREADS="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "loom.ps.server", "--bind", address, "--checkpoint-dir", folder.name],
        env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        print(f"{'model':20} {'mode':6} {'off s/step':>11} {'on s/step':>11} {'on/off':>7}")
        for name, build in _models().items():
            for mode in ("sync", "async"):
                times: dict[bool, list[float]] = {True: [], False: []}
                for rep in range(args.reps):
                    for on in (rep % 2 == 0, rep % 2 == 1):  # alternate which goes first
                        ns = f"{name.split()[0]}-{mode}-{'on' if on else 'off'}-{rep}"
                        times[on].append(_time_steps(build, mode, on, args.steps, address, secret, ns))
                off, on_ = statistics.median(times[False]), statistics.median(times[True])
                print(f"{name:20} {mode:6} {off:11.5f} {on_:11.5f} {on_ / off:7.3f}", flush=True)
    finally:
        server.terminate()
        server.wait()
        folder.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
