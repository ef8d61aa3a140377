"""A strategy, rank 1 slowed in compute: ``straggler_watch_run.py STRATEGY STEPS``.

STRATEGY: ``gossip`` (Gossip, ring), ``hybrid`` (Hybrid(dp=2): a model-parallel job whose replicas are peers),
``localsgd`` (LocalSGD(sync_every=2): its own phase clock), ``sharded`` (ShardedDataParallel(stage=1)) or ``ps``
(ParameterServer(mode="async"), under ``loom run --servers 1``).
Rank 1's forward sleeps 30 ms per step. After the steps rank 0 waits for its watchdog thread to judge every
rank's rows through the last step (`common.judged_stragglers`), then prints one JSON line: its warnings and the phase fields of
its last step record. Run by tests/test_straggler_watch.py.
"""

import json
import sys
from dataclasses import asdict

import torch
from common import judged_stragglers, make_dataset, make_mlp
from observe_run import DELAY_S, SlowForward
from torch import nn

import loom


def main() -> None:
    strategy, steps = sys.argv[1], int(sys.argv[2])
    topo = loom.init()
    inner = make_mlp()
    model = SlowForward(inner, DELAY_S if topo.rank == 1 else 0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    if strategy == "gossip":
        job = loom.Gossip(peers="ring", every=1).setup(model, optimizer, nn.functional.mse_loss)
    elif strategy == "localsgd":
        job = loom.LocalSGD(sync_every=2).setup(model, optimizer, nn.functional.mse_loss)
    elif strategy == "sharded":
        job = loom.ShardedDataParallel(stage=1).setup(model, optimizer, nn.functional.mse_loss)
    elif strategy == "ps":
        job = loom.ParameterServer(mode="async").setup(model, optimizer, nn.functional.mse_loss)
    else:
        job = loom.Hybrid(dp=2).setup(model, optimizer, nn.functional.mse_loss)
    loader = job.loader(make_dataset(), 8) if strategy == "hybrid" else loom.data.loader(make_dataset(), 8)
    epoch = 0
    while job.step < steps:
        loader.set_epoch(epoch)
        for batch in loader:
            job.train_step(batch)
            if job.step == steps:
                break
        epoch += 1
    watch = judged_stragglers(job, topo.is_main)
    record = job.metrics.records[-1]
    if topo.is_main:
        phases = {k: getattr(record, k) for k in ("data_s", "compute_s", "comm_s", "optimizer_s", "time_s")}
        print(json.dumps({"warnings": [asdict(w) for w in watch.warnings], "phases": phases}), flush=True)
    close = getattr(job, "close", None)
    if close is not None:
        close()


if __name__ == "__main__":
    main()
