"""One worker of the loom side of `loom_bench.heal_compare`, run by ``loom run -n R --on-worker-failure heal``.

The loom API only: ``loom.init()``, ``loom.DataParallel``, the job's loader, ``job.train_step``. The same MLP and
batch per replica as the torchft side (`loom_bench.heal_torchft_worker`), as one global batch of ``R * batch``
samples per step. What it relies on from the healing mode (issue 23), and so what the figures mean:

- a step is committed when ``job.train_step(batch)`` returns: a step dropped by the commit vote is retried inside
  ``train_step`` (so its line carries ``committed: true`` and the job's step count ``job.step``); if the healing
  engine instead raises on a dropped step, its exception class is named by ``LOOM_HEAL_DROPPED`` (``module:Class``)
  and the attempt is written with ``committed: false``. Either way the stall is also measured in healthy steps.
- a replacement is started by the launcher with the lost rank's ``RANK`` and heals model, optimizer, step and data
  position inside ``loom.init()``/``setup()``/the loader, so this loop resumes at ``job.step``;
- the members that trained a step are read from the job: ``job.trained_by`` (the ranks;
  `loom.parallel.data.data_parallel.DataParallelJob`), else ``job.members`` (an int or a sequence), else the topology's world
  size (the report then cannot tell steps taken below full membership).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any

# Run as a script: find loom_bench after whatever PYTHONPATH puts first (the harness may put another loom there).
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loom_bench.heal_records import StepWriter, stop_step  # noqa: E402  (first: the start line precedes the torch import)


def _dropped_error() -> type[BaseException] | None:
    name = os.environ.get("LOOM_HEAL_DROPPED")
    if not name:
        return None
    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)


def _members(job: Any, world_size: int, rank: int) -> tuple[int, bool]:
    """(members that trained the last committed step, whether this rank was one): the healing job's
    ``trained_by`` (ranks) when it has one, else ``members``, else the whole world."""
    trained_by = getattr(job, "trained_by", None)
    if trained_by:
        return len(trained_by), rank in trained_by
    members = getattr(job, "members", None)
    if members is None:
        return world_size, True
    return (members, True) if isinstance(members, int) else (len(members), rank in members)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", required=True)
    parser.add_argument("--steps", type=int, required=True, help="stop after this many committed steps")
    parser.add_argument("--batch", type=int, default=32, help="samples per replica per step")
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args(argv)
    writer = StepWriter(args.records, int(os.environ.get("RANK", "0")))

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    import loom

    topo = loom.init()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
        nn.Linear(args.hidden, 10),
    )  # fmt: skip
    job = loom.DataParallel().setup(
        model, torch.optim.SGD(model.parameters(), lr=0.01), nn.functional.cross_entropy
    )
    global_batch = args.batch * topo.world_size
    g = torch.Generator().manual_seed(0)
    n = global_batch * 64  # an epoch of 64 steps; the loop goes on over epochs
    data = TensorDataset(torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g))
    loader = job.loader(data, global_batch_size=global_batch, seed=0)
    dropped = _dropped_error() or ()
    limit = args.steps
    writer.ready()
    try:
        while job.step < limit:
            for batch in loader:
                began = time.time()
                try:
                    job.train_step(batch)
                except dropped:  # type: ignore[misc]
                    members, mine = _members(job, topo.world_size, topo.rank)
                    writer.step(job.step + 1, False, members, mine, t_begin=began)
                    continue
                members, mine = _members(job, topo.world_size, topo.rank)
                writer.step(job.step, True, members, mine, t_begin=began)
                limit = min(
                    args.steps, stop_step(args.records) or args.steps
                )  # the harness's, once it is done
                if job.step >= limit:
                    break
            # (no set_epoch here: job.loader moves to the next epoch by itself after a full pass; this worker
            # called loader.set_epoch(loader.epoch + 1) until 2026-11-26 and so skipped every other epoch, while a
            # replacement resumed at the job's own epoch: its batches differed after step 64, which the healing
            # job's batch fingerprint now refuses, DifferentBatches)
    finally:
        writer.close()
    loom.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
