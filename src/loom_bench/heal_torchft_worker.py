"""One replica group (one process) of the torchft side of `loom_bench.heal_compare`.

Drives torchft 0.2.0 the way its ``train_ddp.py`` example and ``manager_integ_test.py`` do on CPU: a
``ProcessGroupGloo``, a ``Manager`` that joins the lighthouse the harness started on loopback, torchft's
``DistributedDataParallel`` (gradients averaged through ``Manager.allreduce``) and ``OptimizerWrapper`` (a quorum in
``zero_grad``, ``should_commit`` in ``step``). The state a replacement heals from a live peer is the model's and the
optimizer's (torchft's default HTTP checkpoint transport). Each attempt at a step is one record line
(`loom_bench.heal_records`). Runs in the torchft virtual environment only (requirements/bench-torchft.txt); loom
never imports it.

One correction to torchft 0.2.0, without which no survivor survives a kill here: when a peer dies during the
gradient all-reduce, gloo's ``wait`` raises "Connection reset by peer"; ``_ManagedWork.wait`` reports the error to
the Manager (so ``should_commit`` will drop the step) but returns before building its future chain, and torchft's
DDP communication hook then fails ``assert fut._fut`` inside ``backward`` (and a later bucket, given a
``_DummyWork`` once the Manager has errored, has no ``_fut`` at all), so the survivor's process dies. The hook
below is torchft's own with those two cases completed: the error is already reported, so it hands the bucket back
unchanged and lets ``should_commit`` drop the step, which is what torchft's documentation says happens
("If an error occurs during the allreduce ... the Future will be completed with no error"). ``--torchft-ddp-hook
original`` keeps torchft's hook, to show the failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# Run as a script: find loom_bench after whatever PYTHONPATH puts first (the harness may put another loom there).
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loom_bench.heal_records import StepWriter, stop_step  # noqa: E402  (first: the start line precedes the torch import)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", required=True, help="directory of the per-step record files")
    parser.add_argument("--replica", type=int, required=True, help="this replica group's index")
    parser.add_argument("--lighthouse", required=True, help="the lighthouse's address, http://127.0.0.1:PORT")
    parser.add_argument(
        "--steps", type=int, required=True, help="stop after this many committed steps at most"
    )
    parser.add_argument("--batch", type=int, default=32, help="samples per replica per step")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the MLP's two hidden layers")
    parser.add_argument("--min-replicas", type=int, default=2, help="Manager.min_replica_size")
    parser.add_argument("--timeout", type=float, default=30.0, help="the Manager's timeout, seconds")
    parser.add_argument(
        "--pg-timeout", type=float, default=5.0, help="gloo's timeout, seconds (train_ddp.py's 5)"
    )
    parser.add_argument("--ddp-hook", choices=["completed", "original"], default="completed",
                        help="torchft's DDP hook with its error path completed (default), or as released")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    writer = StepWriter(args.records, args.replica)

    from datetime import timedelta

    import torch
    from torch import nn
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    class RecordingOptimizer(OptimizerWrapper):
        """torchft's ``OptimizerWrapper.step``, keeping ``should_commit``'s answer for the record line."""

        committed = False

        def step(self, closure: object = None) -> None:
            if closure is not None:
                raise ValueError("optimizers that use closures are not supported (as in torchft)")
            self.committed = self.manager.should_commit()
            if self.committed:
                self.optim.step()

    class CompletedDDP(DistributedDataParallel):
        """torchft's DDP; its communication hook hands the bucket back when the all-reduce failed (see above)."""

        # No annotations: DDP's hook check refuses the strings that `from __future__ import annotations` makes.
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]
            work = state.allreduce(bucket.buffer())
            work.wait()
            future = work.get_future()
            inner = getattr(future, "_fut", future)  # a _DummyWork's future is a plain, completed one
            if inner is None:  # the wait failed before the chain was built; the Manager holds the error
                inner = torch.futures.Future()
                inner.set_result(bucket.buffer())
                print(f"heal_torchft_worker: all-reduce failed at step {state.current_step()} "
                      f"({state.errored()}); bucket handed back, the step will not commit", flush=True)  # fmt: skip
            return inner

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
        nn.Linear(args.hidden, 10),
    )  # fmt: skip

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    # One process per replica group: this process hosts its group's store (torchft's tests do the same).
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)),
        min_replica_size=args.min_replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"heal_bench_{args.replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
        timeout=timeout,
    )
    ddp = (CompletedDDP if args.ddp_hook == "completed" else DistributedDataParallel)(manager, model)
    optimizer = RecordingOptimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))
    data = torch.Generator().manual_seed(1000 * args.replica + os.getpid() % 1000)
    limit = args.steps
    writer.ready()
    try:
        while manager.current_step() < limit:
            began = time.time()
            optimizer.zero_grad()
            x = torch.randn(args.batch, 784, generator=data)
            y = torch.randint(0, 10, (args.batch,), generator=data)
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            step = manager.current_step() if optimizer.committed else manager.current_step() + 1
            writer.step(
                step, optimizer.committed, manager.num_participants(), manager.is_participating(), began
            )
            limit = min(
                args.steps, stop_step(args.records) or args.steps
            )  # the harness's, once its schedule is done
    finally:
        writer.close()
        manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
