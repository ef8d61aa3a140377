"""PyTorch idioms that behave in loom as in PyTorch (issue 27): each test is the snippet that failed, kept as
the idiom writes it, checked against what PyTorch's own objects do."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import loom
from loom.data import GlobalBatchSampler
from loom.topology import Topology

ONE = Topology(0, 1, 0, 1, "none")


def _dataset(n: int = 37) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


# -- iter(loader) starts the epoch afresh -----------------------------------------------------------------------
def _tutorial_epochs(train_data, epochs: int) -> list[list[int]]:
    """The DDP tutorial's ``Trainer._run_epoch`` (multigpu_torchrun.py): probe the batch size with
    ``next(iter(...))``, set the epoch, train on every batch. Returns the sample ids trained per epoch."""
    seen = []
    for epoch in range(epochs):
        b_sz = len(next(iter(train_data))[0])
        assert b_sz > 0
        train_data.sampler.set_epoch(epoch)
        seen.append([int(i) for _, targets in train_data for i in targets])
    return seen


def test_the_batch_size_probe_does_not_eat_the_first_batch_as_with_dataloader():
    dataset = _dataset()
    # DataLoader's behaviour, the reference: every epoch trains on every sample.
    reference = DataLoader(dataset, batch_size=8, sampler=torch.utils.data.DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=0))  # fmt: skip
    assert all(sorted(ids) == list(range(37)) for ids in _tutorial_epochs(reference, 2))
    loader = loom.data.loader(dataset, global_batch_size=8, seed=0, topology=ONE)
    epochs = _tutorial_epochs(loader, 3)
    assert [sorted(ids) for ids in epochs] == [list(range(37))] * 3
    assert [len(ids) for ids in epochs] == [37] * 3
    # and the order is the epoch's full order, first batch included
    assert epochs[1] == loader.sampler.order(1).tolist()


def test_every_iter_restarts_the_epoch_and_two_iterators_are_independent():
    loader = loom.data.loader(_dataset(20), global_batch_size=5, seed=3, topology=ONE)
    a, b = iter(loader), iter(loader)
    first_a = next(a)[1].tolist()
    assert next(b)[1].tolist() == first_a
    assert next(iter(loader))[1].tolist() == first_a
    assert loader.epoch == 0
    assert len(list(loader)) == 4 and loader.epoch == 1  # a finished pass moves on, as before


def test_a_restored_position_is_taken_by_the_first_iteration_only():
    loader = loom.data.loader(_dataset(), global_batch_size=8, seed=1, topology=ONE)
    it = iter(loader)
    done = [next(it)[1].tolist() for _ in range(2)]
    state = loader.state_dict()
    resumed = loom.data.loader(_dataset(), global_batch_size=8, seed=1, topology=ONE)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the usual loop's set_epoch keeps the restored position
    rest = [batch[1].tolist() for batch in resumed]
    assert sum(done + rest, []) == resumed.sampler.order(0).tolist()  # exactly the epoch, once
    again = loom.data.loader(_dataset(), global_batch_size=8, seed=1, topology=ONE)
    again.load_state_dict(state)
    assert next(iter(again))[1].tolist() == rest[0]
    assert next(iter(again))[1].tolist() == done[0]  # the second iteration starts the epoch afresh


# -- len(sampler) is DistributedSampler's -----------------------------------------------------------------------
def test_len_of_the_sampler_counts_this_ranks_samples_like_distributed_sampler():
    size, world = 40, 4
    for rank in range(world):
        theirs = torch.utils.data.DistributedSampler(range(size), num_replicas=world, rank=rank)
        ours = GlobalBatchSampler(size, 8, rank=rank, world_size=world)
        assert len(ours) == len(theirs) == 10
        assert ours.steps_per_epoch() == 5
    # uneven: 37 samples, batches of 8 over 3 replicas: no padding, so the shares are the samples handed out
    for rank in range(3):
        sampler = GlobalBatchSampler(37, 8, rank=rank, world_size=3)
        assert len(sampler) == sum(b.share.numel() for b in sampler)
    assert sum(len(GlobalBatchSampler(37, 8, rank=r, world_size=3)) for r in range(3)) == 37
    loader = loom.data.loader(_dataset(), 8, topology=ONE)
    assert len(loader) == loader.sampler.steps_per_epoch() == 5  # len(loader) stays batches, as DataLoader's


# -- one process gets what torchrun --nproc_per_node 1 gives ----------------------------------------------------
TUTORIAL_SCRIPT = """
import json, os, sys
import pytest
import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group
import loom

topo = loom.init()                       # the tutorial's ddp_setup()
keys = [k for k in os.environ if k in sys.argv[1].split(",") or k.startswith("TORCHELASTIC_")]
print("ENV " + json.dumps({k: os.environ[k] for k in sorted(keys)}), flush=True)
x = torch.ones(2)
dist.all_reduce(x)
dist.barrier()
print(f"GROUP {dist.get_world_size()} {dist.get_rank()} {dist.get_backend()} {x.tolist()} {topo.backend}")
model = torch.nn.Linear(3, 1)
job = loom.DataParallel().setup(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.MSELoss())
data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
for batch in job.loader(data, global_batch_size=4):
    job.train_step(batch)
destroy_process_group()                  # the tutorial's last line, unconditional
print("DESTROYED", flush=True)
"""
TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def _run_script(tmp_path, prefix: list[str]) -> tuple[dict, str]:
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "tutorial.py"
    script.write_text(TUTORIAL_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("LOOM_")}
    env["LOOM_JOB_SECRET"] = os.urandom(32).hex()
    proc = subprocess.run(
        [sys.executable, *prefix, str(script), ",".join(TORCHRUN_VARIABLES)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "DESTROYED" in out and "Traceback" not in out and "exit barrier failed" not in out, out
    env_line = next(line for line in out.splitlines() if "ENV {" in line)
    return json.loads(env_line.split("ENV ", 1)[1]), out


@pytest.mark.timeout(240)
def test_loom_run_n1_gives_the_group_and_environment_torchrun_n1_gives(tmp_path):
    loom_env, loom_out = _run_script(tmp_path, ["-m", "loom.launch.cli", "run", "-n", "1"])
    torch_env, torch_out = _run_script(tmp_path, ["-m", "torch.distributed.run", "--nproc_per_node", "1"])
    for out in (loom_out, torch_out):
        assert "GROUP 1 0 gloo [1.0, 1.0] none" in out, out
    # the same variables (less torchrun's signal list for its own agent), with the same values where they do
    # not name this run (port, run id, error file) or spell loopback differently (127.0.0.1 / localhost)
    assert set(torch_env) - {"TORCHELASTIC_SIGNALS_TO_HANDLE"} <= set(loom_env), (torch_env, loom_env)
    assert loom_env["MASTER_ADDR"] in ("127.0.0.1", "localhost")
    same = [k for k in TORCHRUN_VARIABLES if k not in ("MASTER_ADDR", "MASTER_PORT")]
    same.append("TORCHELASTIC_RESTART_COUNT")
    assert {k: loom_env[k] for k in same} == {k: torch_env[k] for k in same}


@pytest.mark.timeout(120)
def test_plain_python_gets_a_group_of_one_too(tmp_path):
    env, out = _run_script(tmp_path, [])
    assert env == {} and "GROUP 1 0 gloo [1.0, 1.0] none" in out


def test_current_alone_starts_no_group_and_shutdown_survives_a_destroyed_group():
    import torch.distributed as dist

    from loom import topology

    assert not dist.is_initialized()
    assert topology.current().world_size == 1 and not dist.is_initialized()
    try:
        loom.init()
        assert dist.is_initialized() and dist.get_world_size() == 1
        dist.destroy_process_group()  # the script's own
        loom.shutdown()  # and loom's at exit: no error
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        loom.shutdown()


# -- the own-loop model: the model's attributes, evaluation without no_grad -----------------------------------
@pytest.mark.timeout(120)
def test_own_loop_model_forwards_attributes_and_evaluates_without_no_grad(workers, tmp_path):
    import importlib.util
    from pathlib import Path

    from safetensors.torch import load_file

    out = tmp_path / "params.safetensors"
    outputs = workers("idioms_own_loop.py", 2, str(out), timeout=110)
    spec = importlib.util.spec_from_file_location(
        "idioms_own_loop", Path(__file__).parent / "workers" / "idioms_own_loop.py"
    )
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)  # type: ignore[union-attr]
    reference, lines = worker.main()  # one process: raw_model is the OwnLoopModel itself
    for rank in (0, 1):
        printed = outputs[rank].splitlines()
        assert printed[0] == lines[0] == "mfu 134.0 module True"
        assert "backward through an evaluation call: refused, naming no_grad True" in printed
        for mine, theirs in zip(printed[1:3], lines[1:3], strict=True):  # the test losses, equal
            assert abs(float(mine.split()[-1]) - float(theirs.split()[-1])) < 1e-4, (mine, theirs)
    distributed = load_file(out)
    assert max((distributed[k] - reference[k]).abs().max().item() for k in reference) < 1e-6


# -- loom.ray and loom.spark are reachable from `import loom`, lazily -------------------------------------------
@pytest.mark.timeout(90)
def test_loom_ray_and_loom_spark_are_reachable_without_importing_ray_or_spark():
    import subprocess
    import sys

    code = """
import sys
import loom
heavy = lambda: sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "pyspark") or m in ("loom.ray", "loom.spark"))
assert heavy() == [], heavy()
assert "ray" in dir(loom) and "spark" in dir(loom)
assert callable(loom.ray.run) and callable(loom.spark.run)   # the README's loom.ray.run(...), as written
assert sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "pyspark")) == [], heavy()
try:
    loom.no_such_thing
except AttributeError as error:
    assert "no_such_thing" in str(error)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=80)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
