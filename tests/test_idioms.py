"""PyTorch idioms that behave in loom as in PyTorch (issue 27): each test is the snippet that failed, kept as
the idiom writes it, checked against what PyTorch's own objects do."""

from __future__ import annotations

import pytest
import torch
from conftest import torch_reference
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_every_iter_restarts_the_epoch_and_two_iterators_are_independent():
    loader = loom.data.loader(_dataset(20), global_batch_size=5, seed=3, topology=ONE)
    a, b = iter(loader), iter(loader)
    first_a = next(a)[1].tolist()
    assert next(b)[1].tolist() == first_a
    assert next(iter(loader))[1].tolist() == first_a
    assert loader.epoch == 0
    assert len(list(loader)) == 4 and loader.epoch == 1  # a finished pass moves on, as before


@pytest.mark.unit
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
@pytest.mark.unit
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


@pytest.mark.system
@pytest.mark.timeout(240)
def test_loom_run_n1_gives_the_group_and_environment_torchrun_n1_gives(tmp_path):
    loom_env, loom_out = _run_script(tmp_path, ["-m", "loom.cli", "run", "-n", "1"])
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


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_plain_python_gets_a_group_of_one_too(tmp_path):
    env, out = _run_script(tmp_path, [])
    assert env == {} and "GROUP 1 0 gloo [1.0, 1.0] none" in out


@pytest.mark.unit
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
@pytest.mark.multiprocess
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
@pytest.mark.multiprocess
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


# -- Pipeline refuses at setup() a model that is not a chain ----------------------------------------------------
class TutorialTransformer(torch.nn.Module):
    """PyTorch's pipelining tutorial's ``Transformer`` (small): layers in a ModuleDict, each called ``layer(h, h)``
    (``dict_=False``: a ModuleList; ``dropout``: the decoder layers', 0 for an exact comparison)."""

    def __init__(self, dim=16, n_layers=2, n_heads=2, vocab_size=32, dict_=True, dropout=0.1) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab_size, dim)
        layers = [torch.nn.TransformerDecoderLayer(dim, n_heads, dropout=dropout) for _ in range(n_layers)]
        if dict_:
            self.layers = torch.nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
        else:
            self.layers = torch.nn.ModuleList(layers)
        self.norm = torch.nn.LayerNorm(dim)
        self.output = torch.nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens
        for layer in self.layers.values() if isinstance(self.layers, torch.nn.ModuleDict) else self.layers:
            h = layer(h, h)
        h = self.norm(h) if self.norm else h
        return self.output(h).float() if self.output else h


@pytest.mark.unit
@pytest.mark.parametrize(
    ("module_dict", "named"),
    [(True, "'layers' (ModuleDict) has no forward"), (False, "'layers.0' (TransformerDecoderLayer) needs 2")],
)
def test_pipeline_refuses_the_tutorial_transformer_at_setup_naming_the_module(module_dict, named):
    model = TutorialTransformer(dict_=module_dict)
    strategy = loom.Pipeline(stages=2, topology=Topology(0, 2, 0, 2, "gloo"))  # refused before any collective
    with pytest.raises(ValueError) as refused:
        strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.cross_entropy)
    message = str(refused.value)
    assert "Pipeline cannot cut TutorialTransformer" in message and named in message, message
    assert "nn.Sequential" in message and "HINT" in message


@pytest.mark.unit
def test_a_chain_is_still_accepted():
    from loom.parallel.pipeline.pipeline_split import chain_layers

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert [n for n, _ in chain_layers(model)] == ["0", "1", "2"]
    encoder = torch.nn.TransformerEncoderLayer(4, 2)  # one required argument after an Embedding: a chain
    assert len(chain_layers(torch.nn.Sequential(torch.nn.Embedding(8, 4), encoder))) == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_the_tutorial_transformer_pipeline_refused_at_setup_tensor_parallel_trains_it(workers):
    outputs = workers("idioms_pipeline.py", 2, timeout=140)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    try:
        import idioms_pipeline
    finally:
        sys.path.pop(0)
    model, data = idioms_pipeline.model_and_data()
    x, y = data.tensors
    reference = float(idioms_pipeline.loss_fn(model(x), y))
    for out in outputs:
        lines = out.splitlines()
        assert lines[0].startswith("pipeline: refused at setup: Pipeline cannot cut TutorialTransformer"), out
        assert "'layers' (ModuleDict)" in lines[0]
        assert abs(float(lines[1].split()[-1]) - reference) < 1e-5, (lines[1], reference)


# -- a nanoGPT-style port that keeps get_batch ------------------------------------------------------------------
def _script_lines(name: str) -> list[str]:
    from pathlib import Path

    text = (Path(__file__).parent / "workers" / name).read_text()
    return text.split("# --- nanoGPT train.py ---\n", 1)[1].splitlines()


@pytest.mark.unit
def test_the_nanogpt_port_touches_a_handful_of_lines():
    import difflib

    diff = [
        d
        for d in difflib.unified_diff(_script_lines("nanogpt_ddp.py"), _script_lines("nanogpt_port.py"), n=0)
        if d[:3] not in ("---", "+++") and d[:2] != "@@"
    ]
    added, removed = sum(d.startswith("+") for d in diff), sum(d.startswith("-") for d in diff)
    print(f"nanoGPT-style port: +{added}/-{removed}\n" + "\n".join(diff))
    assert (added, removed) == (3, 2), diff


def _run(args: list[str], env_extra: dict | None = None, timeout: float = 100) -> str:
    import os
    import subprocess
    import sys

    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env.update(env_extra or {}, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_nanogpt_port_equals_one_process_on_the_same_draws_and_nanogpts_own_ddp(workers, tmp_path):
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    scripts = Path(__file__).parent / "workers"
    port, ported = tmp_path / "port.safetensors", {}
    outputs = workers("nanogpt_port.py", 2, str(port), timeout=140)
    assert "mfu" in outputs[0] and "step 2: train loss" in outputs[0] and "step 0" not in outputs[1]
    draws = [json.loads(Path(f"{port}.rank{r}.json").read_text()) for r in (0, 1)]
    ported = load_file(port)
    # One process, the unmodified script, on the ranks' draws: per optimizer step, 4 micro-batches of 3
    # (rank 0's 2, then rank 1's 2) where the 2 ranks had 2 micro-batches of 3 each.
    merged = [draws[r][i * 2 + m] for i in range(5) for r in (0, 1) for m in range(2)] + [draws[0][10]]
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps(merged))
    one = tmp_path / "one.safetensors"
    _run([str(scripts / "nanogpt_ddp.py"), str(one), str(replay)])
    reference = load_file(one)
    worst = max((ported[k] - reference[k]).abs().max().item() for k in reference)
    print(f"port at 2 processes vs one process on the same draws: max |diff| = {worst:.3g}")
    assert worst < 1e-5
    # nanoGPT's own DDP (torchrun, DDP(model)) at 2 processes: the same draws (same seeds), the same result
    ddp = tmp_path / "ddp.safetensors"
    torchrun = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        str(scripts / "nanogpt_ddp.py"),
        str(ddp),
    ]
    # started again on torch's own teardown abort only (conftest.torch_reference)
    torch_reference(lambda: _run(torchrun))
    assert json.loads(Path(f"{ddp}.rank1.json").read_text()) == draws[1]
    own_ddp = load_file(ddp)
    worst_ddp = max((ported[k] - own_ddp[k]).abs().max().item() for k in reference)
    print(f"port at 2 processes vs nanoGPT's DDP at 2: max |diff| = {worst_ddp:.3g}")
    assert worst_ddp < 1e-5


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_the_nanogpt_port_at_one_launched_process_is_bitwise_the_plain_script(workers, tmp_path):
    from pathlib import Path

    from safetensors.torch import load_file

    port, plain = tmp_path / "port.safetensors", tmp_path / "plain.safetensors"
    outputs = workers("nanogpt_port.py", 1, str(port), timeout=100)  # RANK set: ddp, loom's group of one
    assert "mfu" in outputs[0]  # raw_model = model.module: estimate_mfu reached on one process
    _run([str(Path(__file__).parent / "workers" / "nanogpt_ddp.py"), str(plain)])  # no RANK: no ddp
    ported, reference = load_file(port), load_file(plain)
    assert all(torch.equal(ported[k], reference[k]) for k in reference)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_idioms_page_code_blocks_run():
    import re
    import subprocess
    import sys
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "idioms.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert len(blocks) == 3
    for block in blocks:  # each in a fresh process, as a script would run it
        result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=100)
        assert result.returncode == 0, block + result.stderr[-2000:]
