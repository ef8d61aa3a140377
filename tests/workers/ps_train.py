"""Train with ParameterServer; one JSON line per run (losses, final parameters, staleness, clocks).

The argument is JSON ``{"tag": str, "runs": [run, ...]}``; a run has: mode, staleness, steps, global_batch,
problem ("mlp" or "lsq"), optimizer, servers (indices into LOOM_PS_ADDRS), slow_rank/slow_s (sleep per step),
barrier_dir (every worker set up before any trains; then each sleeps pace_s per step, so that their steps
interleave however loaded the machine),
kill_rank/kill_step (SIGKILL itself there), timeout_s (worker timeout), lr (lsq), scheduler ("step": StepLR(2, 0.5),
"lambda": LambdaLR(1 / (1 + step)); stepped after every train_step).

Run by tests/test_ps_cluster.py.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from common import least_squares, make_dataset, make_mlp, make_optimizer
from faults import Fault, Injector
from torch import nn

import loom
from loom.parallel.ps.parameter_server import ParameterServer
from loom.topology import Topology

cfg = json.loads(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# No process group: the parameter-server strategy talks to the servers only, so a killed peer cannot hang us.
topo = Topology(rank, world, rank, world, "none")


def make_scheduler(name, opt):
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if name == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return None


job_config = json.loads(sys.argv[1])
all_addresses = os.environ["LOOM_PS_ADDRS"].split(",")
for index, cfg in enumerate(job_config["runs"]):
    optimizer = cfg.get("optimizer", "sgd")
    addresses = [all_addresses[i] for i in cfg.get("servers", [0])]
    if cfg.get("problem", "mlp") == "lsq":
        data = least_squares()
        torch.manual_seed(0)
        model = nn.Linear(8, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.05))
    else:
        data = make_dataset()
        model = make_mlp()
        opt = make_optimizer(optimizer, model)
    strategy = ParameterServer(
        mode=cfg["mode"],
        staleness=cfg.get("staleness", 0),
        worker_timeout_s=cfg.get("timeout_s", 30.0),
        addresses=tuple(addresses),
        namespace=f"{job_config['tag']}-{index}",
        topology=topo,
    )
    job = strategy.setup(model, opt, nn.functional.mse_loss)
    scheduler = make_scheduler(cfg.get("scheduler"), opt)
    loader = loom.data.loader(data, cfg["global_batch"], seed=1, topology=topo)
    kill = [Fault("kill", cfg["kill_rank"], cfg["kill_step"] + 1)] if "kill_rank" in cfg else []
    faults = Injector(rank, kill)
    if "barrier_dir" in cfg:
        Path(cfg["barrier_dir"], str(rank)).touch()
        deadline = time.monotonic() + 60
        while len(os.listdir(cfg["barrier_dir"])) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    losses, error, started = [], None, time.perf_counter()
    try:
        while len(losses) < cfg["steps"]:
            for batch in loader:
                faults.before_step(len(losses) + 1)
                if rank == cfg.get("slow_rank"):
                    time.sleep(cfg["slow_s"])
                time.sleep(cfg.get("pace_s", 0))
                losses.append(job.train_step(batch))
                if scheduler is not None:
                    scheduler.step()
                if len(losses) == cfg["steps"]:
                    break
    except RuntimeError as e:
        error = str(e)
    out = {"run": index, "namespace": strategy.config.namespace, "losses": losses, "error": error,
           "elapsed": time.perf_counter() - started, "staleness": job.metrics.staleness,
           "clocks": job.metrics.clocks, "record_staleness": [r.staleness for r in job.metrics.records]}  # fmt: skip
    if error is None:
        out["params"] = {k: v.flatten().tolist() for k, v in job.state_dict()["model"].items()}
        out["traffic"] = job.client.traffic
    print(json.dumps(out), flush=True)
    job.close()
