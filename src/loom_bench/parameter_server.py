"""Benchmark: parameter-server modes against DataParallel with one slow worker, and server update rates.

``python -m loom_bench.parameter_server [--out benchmarks/reports] [--budget 4]`` runs, in one invocation on this machine:

1. 4 workers on least squares (d=64); each step "computes" for ``base_s`` (a sleep, so that the 3x slowdown is
   exact and the 2 cores are not the bottleneck) and worker 3 for ``3 * base_s``. For ``sync``, ``ssp`` (s=2),
   ``async`` on 2 servers and for `DataParallel` (gloo): samples/s over a fixed wall-clock budget, and the time
   until rank 0's parameters reach the target loss on the whole data set.
2. Server updates/s, ``async`` with 4 workers and no simulated compute, on 1 vs 2 servers (a 1M-parameter MLP).

Writes ``ps.json`` and ``ps.md`` into ``--out``. Figures depend on the machine's load; the report records it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["run_benchmark"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _problem(d: int = 64, n: int = 4096):
    import torch

    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=g)
    return x, x @ torch.randn(d, 1, generator=g) + 0.01 * torch.randn(n, 1, generator=g)


def _updates_worker(cfg: dict, rank: int) -> None:
    """One worker of the server-updates case: async pushes with no simulated compute; prints its step count."""
    import torch
    from torch import nn

    from loom.parallel.ps.parameter_server import ParameterServer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 512))
    x, y = torch.randn(8, 512), torch.randn(8, 512)
    job = ParameterServer(mode="async", namespace=cfg["ns"]).setup(
        model, torch.optim.SGD(model.parameters(), lr=1e-3), nn.functional.mse_loss
    )
    end, steps = time.monotonic() + cfg["budget"], 0
    while time.monotonic() < end:
        job.train_step((x, y))
        steps += 1
    print(json.dumps({"rank": rank, "steps": steps}), flush=True)
    job.close()


def _worker(cfg: dict) -> None:
    """One worker of one benchmark case; prints a JSON line with its samples and rank 0's loss curve."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import loom
    from loom.parallel.data.data_parallel import DataParallelJob
    from loom.parallel.ps.parameter_server import ParameterServer, ParameterServerJob

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if cfg["kind"] == "updates":
        _updates_worker(cfg, rank)
        return
    topo = loom.init() if cfg["mode"] == "dp" else None
    if topo is None:
        from loom.topology import Topology

        world = int(os.environ["WORLD_SIZE"])
        topo = Topology(rank, world, rank, world, "none")
    x, y = _problem()
    torch.manual_seed(0)
    model = nn.Linear(x.shape[1], 1, bias=False)
    lr = 0.05 if cfg["mode"] in ("sync", "dp") else 0.05 / topo.world_size
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    job: DataParallelJob | ParameterServerJob
    if cfg["mode"] == "dp":
        job = loom.DataParallel(topology=topo).setup(model, opt, nn.functional.mse_loss)
    else:
        job = ParameterServer(mode=cfg["mode"], staleness=cfg.get("staleness", 0), namespace=cfg["ns"],
                              topology=topo).setup(model, opt, nn.functional.mse_loss)  # fmt: skip
    loader = loom.data.loader(TensorDataset(x, y), 64, seed=0, topology=topo)
    delay = cfg["base_s"] * (3 if rank == topo.world_size - 1 else 1)
    started, samples, curve, stop = time.monotonic(), 0, [], False
    while not stop:
        for batch in loader:
            time.sleep(delay)
            job.train_step(batch)
            samples += len(batch[0])
            if rank == 0:
                with torch.no_grad():
                    curve.append((time.monotonic() - started, nn.functional.mse_loss(model(x), y).item()))
            stop = time.monotonic() - started > cfg["budget"]
            if cfg["mode"] == "dp":  # every replica must stop at the same step
                flag = torch.tensor([float(stop)])
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
                stop = bool(flag.item())
            if stop:
                break
    print(json.dumps({"rank": rank, "samples": samples, "elapsed": time.monotonic() - started,
                      "curve": curve}), flush=True)  # fmt: skip
    if isinstance(job, ParameterServerJob):  # DataParallel has nothing to close
        job.close()


def _run_workers(n: int, cfg: dict, env: dict[str, str]) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(n):
        child = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                     LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                     GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **env)  # fmt: skip
        cmd = [sys.executable, "-m", "loom_bench.parameter_server", "--worker", json.dumps(cfg)]
        procs.append(subprocess.Popen(cmd, env=child, stdout=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=cfg["budget"] + 120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")]


def _servers(count: int, secret: str) -> tuple[list[str], list[subprocess.Popen]]:
    addresses = [f"127.0.0.1:{_free_port()}" for _ in range(count)]
    env = dict(os.environ, LOOM_JOB_SECRET=secret, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loom.ps.server",
                "--index",
                str(i),
                "--num-servers",
                str(count),
                "--bind",
                a,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        for i, a in enumerate(addresses)
    ]
    return addresses, procs


def run_benchmark(out_dir: Path, budget_s: float = 4.0, base_s: float = 0.01, target: float = 0.05) -> dict:
    secret = secrets.token_hex(32)
    addresses, procs = _servers(2, secret)
    env = {"LOOM_JOB_SECRET": secret, "LOOM_PS_ADDRS": ",".join(addresses)}
    results: dict = {"load_average": os.getloadavg(), "budget_s": budget_s, "base_step_s": base_s,
                     "target_loss": target, "modes": {}, "server_updates_per_s": {}}  # fmt: skip
    try:
        for mode, staleness in (("async", 0), ("ssp", 2), ("sync", 0), ("dp", 0)):
            cfg = {"kind": "modes", "mode": mode, "staleness": staleness, "ns": f"bench-{mode}",
                   "budget": budget_s, "base_s": base_s}  # fmt: skip
            rows = _run_workers(4, cfg, env)
            curve = next(r["curve"] for r in rows if r["rank"] == 0)
            reach = next((t for t, loss in curve if loss <= target), None)
            wall = max(r["elapsed"] for r in rows)
            results["modes"][mode if mode != "ssp" else "ssp(s=2)"] = {
                "samples_per_s": sum(r["samples"] for r in rows) / wall,
                "time_to_target_s": reach,
                "final_loss": curve[-1][1],
                "samples_by_rank": [r["samples"] for r in sorted(rows, key=lambda r: r["rank"])],
            }
        for count in (1, 2):
            cfg = {"kind": "updates", "ns": f"updates-{count}", "budget": budget_s}
            rows = _run_workers(4, cfg, {**env, "LOOM_PS_ADDRS": ",".join(addresses[:count])})
            results["server_updates_per_s"][str(count)] = sum(r["steps"] for r in rows) / budget_s
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ps.json").write_text(json.dumps(results, indent=1))
    (out_dir / "ps.md").write_text(_markdown(results))
    return results


def _markdown(r: dict) -> str:
    lines = [
        "# Parameter servers: modes vs DataParallel, one worker 3x slower",
        "",
        f"4 workers, least squares d=64, global batch 64; simulated compute {r['base_step_s'] * 1000:.0f} ms/step,"
        f" worker 3 three times that; {r['budget_s']} s per mode; 2 servers; 2-core machine, load average "
        f"{r['load_average'][0]:.1f} at start. Target: full-data loss <= {r['target_loss']} (rank 0's view).",
        "",
        "| mode | samples/s | time to target (s) | final loss | samples by rank |",
        "|---|---|---|---|---|",
    ]
    for mode, m in r["modes"].items():
        reach = "not reached" if m["time_to_target_s"] is None else f"{m['time_to_target_s']:.2f}"
        lines.append(f"| {mode} | {m['samples_per_s']:.0f} | {reach} | {m['final_loss']:.4f} | "
                     f"{m['samples_by_rank']} |")  # fmt: skip
    lines += ["", "Server updates/s (async, 4 workers, 1M-parameter MLP, no simulated compute):", ""]
    lines += [f"- {k} server(s): {v:.0f} updates/s" for k, v in r["server_updates_per_s"].items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m loom_bench.parameter_server", description=__doc__.splitlines()[0]
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path("benchmarks/reports"))
    p.add_argument("--budget", type=float, default=4.0, help="wall seconds per mode")
    args = p.parse_args()
    if args.worker is not None:
        _worker(json.loads(args.worker))
        return 0
    print(_markdown(run_benchmark(args.out, args.budget)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
