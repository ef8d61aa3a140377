"""The GPU lane (`make test-gpu` on a machine with CUDA; skipped, and reported as skipped, elsewhere).

What issue 35 asks of a GPU: the model stays on the GPU (one process included), every strategy that can runs on
CUDA equal to one process on the CPU (float64, so summation order cannot hide a wrong step), checkpoints move
between a GPU and a CPU, a one-GPU host refuses ``-n 2`` up front and shares its GPU when asked.

``LOOM_GPU_LANE_DEVICE=cpu`` runs these same tests on the CPU (a dry run of the tests' own logic on a machine
without a GPU: it proves nothing about CUDA and is not how the lane's results are counted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import loom

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from gpu_common import make_data, make_model, reference_losses  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("LOOM_GPU_LANE_DEVICE", "cuda:0")
WORKERS = Path(__file__).parent / "workers"
ONE = loom.Topology(0, 1, 0, 1, "none", device_name=DEVICE)
CPU = loom.Topology(0, 1, 0, 1, "none", device_name="cpu")


def _steps(job, loader, steps: int) -> list[float]:
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            losses.append(job.train_step(batch))
            if len(losses) == steps:
                break
    return losses


def _close(a: list[float], b: list[float], tol: float = 1e-9) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


@pytest.mark.unit
@pytest.mark.timeout(300)
def test_one_process_keeps_a_model_built_on_the_gpu_there_silently_and_matches_the_cpu(capsys):
    model, optimizer = make_model(DEVICE)
    job = loom.DataParallel(topology=ONE).setup(model, optimizer, nn.functional.mse_loss)
    assert {str(p.device) for p in model.parameters()} == {str(torch.device(DEVICE))}
    assert "was moved" not in capsys.readouterr().err
    losses = _steps(job, job.loader(make_data(), global_batch_size=16, seed=0), 6)
    assert {str(p.device) for p in job.module.parameters()} == {str(torch.device(DEVICE))}
    assert _close(losses, reference_losses(6))


@pytest.mark.unit
@pytest.mark.timeout(120)
def test_a_gpu_jobs_loader_hands_out_shares_already_on_the_gpu_equal_to_the_cpus():
    from loom.data.loader import loader

    job = loom.DataParallel(topology=ONE).setup(*make_model(DEVICE), nn.functional.mse_loss)
    on_gpu = job.loader(make_data(), global_batch_size=16, seed=0)
    shares = list(zip(loader(make_data(), 16, seed=0, topology=CPU), on_gpu, strict=True))
    assert len(shares) == 6 and on_gpu.state_dict()["epoch"] == 1
    for a, b in shares:
        assert all(t.device == torch.device(DEVICE) for t in b)
        assert all(torch.equal(x, y.cpu()) for x, y in zip(a, b, strict=True))
        assert (a.epoch, a.step, a.fingerprint) == (b.epoch, b.step, b.fingerprint)
    assert (on_gpu._prefetcher is not None) == (DEVICE != "cpu")  # gathered and copied ahead on a GPU


@pytest.mark.unit
@pytest.mark.timeout(300)
def test_a_cpu_model_is_moved_to_the_jobs_gpu_with_one_line_its_optimizer_state_too(capsys):
    if DEVICE == "cpu":
        pytest.skip("nothing to move on the dry run")
    model, _ = make_model("cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = make_data().tensors
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()  # Adam's moments exist, on the CPU
    optimizer.zero_grad()
    job = loom.DataParallel(topology=ONE).setup(model, optimizer, nn.functional.mse_loss)
    assert f"this job trains on {torch.device(DEVICE)}, so it was moved there" in capsys.readouterr().err
    assert all(p.device == torch.device(DEVICE) for p in job.module.parameters())
    assert all(optimizer.state[p]["exp_avg"].device == torch.device(DEVICE) for p in model.parameters())
    assert len(_steps(job, job.loader(make_data(), global_batch_size=16, seed=0), 2)) == 2


@pytest.mark.unit
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_stages_on_one_gpu_match_the_cpu(stage):
    model, optimizer = make_model(DEVICE)
    job = loom.ShardedDataParallel(stage=stage, topology=ONE).setup(model, optimizer, nn.functional.mse_loss)
    losses = _steps(job, job.loader(make_data(), global_batch_size=16, seed=0), 6)
    assert _close(losses, reference_losses(6))


@pytest.mark.unit
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["localsgd", "diloco"])
def test_replica_strategies_on_one_gpu_match_themselves_on_the_cpu(name):
    def run(topology, device):
        strategy = loom.LocalSGD(sync_every=2, topology=topology) if name == "localsgd" else loom.DiLoCo(
            sync_every=2, topology=topology)  # fmt: skip
        job = strategy.setup(*make_model(device), nn.functional.mse_loss)
        return _steps(job, job.loader(make_data(), global_batch_size=16, seed=0), 6)

    assert _close(run(ONE, DEVICE), run(CPU, "cpu"))


@pytest.mark.unit
@pytest.mark.timeout(600)
def test_fit_resumes_on_the_gpu_bitwise_and_its_checkpoint_loads_on_the_cpu(tmp_path):
    def fit(directory, steps, topology, device):
        torch.manual_seed(5)  # the dropout draws from the device's generator, saved in the checkpoint
        model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 4)).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        job = loom.DataParallel(topology=topology).setup(model, optimizer, nn.functional.mse_loss)
        data = torch.utils.data.TensorDataset(*(t.float() for t in make_data().tensors))
        loom.fit(job, job.loader(data, global_batch_size=16, seed=0), steps=steps, checkpoint_dir=directory,
                 checkpoint_every=3, progress=False)  # fmt: skip
        return [p.detach().cpu().clone() for p in model.parameters()]

    straight = fit(tmp_path / "straight", 12, ONE, DEVICE)
    fit(tmp_path / "resumed", 6, ONE, DEVICE)
    resumed = fit(tmp_path / "resumed", 12, ONE, DEVICE)  # new objects, as a restarted script builds them
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed, strict=True))
    on_cpu = fit(tmp_path / "resumed", 12, CPU, "cpu")  # the GPU's checkpoint, loaded where there is no GPU
    assert all(torch.equal(a, b) for a, b in zip(straight, on_cpu, strict=True))
    from loom.checkpoint.export import model_state_dict

    step, exported = model_state_dict(tmp_path / "resumed")
    assert step == 12 and all(t.device.type == "cpu" for t in exported.values())


@pytest.mark.multiprocess  # torch.compile's inductor starts compiler processes
@pytest.mark.timeout(300)
def test_compiled_and_bf16_autocast_models_train_under_dataparallel():
    class Autocast(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
                return self.inner(x).double()

    model, optimizer = make_model(DEVICE)
    compiled = loom.DataParallel(topology=ONE).setup(torch.compile(model), optimizer, nn.functional.mse_loss)
    losses = _steps(compiled, compiled.loader(make_data(), global_batch_size=16, seed=0), 4)
    assert _close(losses, reference_losses(4), tol=1e-6)
    model, optimizer = make_model(DEVICE)
    mixed = loom.DataParallel(topology=ONE).setup(Autocast(model), optimizer, nn.functional.mse_loss)
    losses = _steps(mixed, mixed.loader(make_data(), global_batch_size=16, seed=0), 4)
    assert _close(losses, reference_losses(4), tol=5e-2)  # bf16 has 8 bits of mantissa


def _loom_run(tmp_path: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    if DEVICE == "cpu":
        env["LOOM_DEVICE"] = "cpu"
    return subprocess.run([sys.executable, "-m", "loom.cli", "run", "--run-dir", str(tmp_path / "run"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def _records(out: str) -> list[dict]:
    rows = [json.loads(line.split(": ", 1)[1]) for line in out.splitlines() if ': {"rank"' in line]
    return sorted(rows, key=lambda r: r["rank"])


def _gpus() -> int:
    return torch.cuda.device_count() if DEVICE != "cpu" else 0


@pytest.mark.system
@pytest.mark.timeout(300)
def test_loom_run_on_one_process_trains_on_cuda_0_and_matches_the_cpu(tmp_path):
    done = _loom_run(tmp_path, "-n", "1", str(WORKERS / "gpu_train.py"), "dp", "6")
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = _records(done.stdout)
    assert record["device"] == str(torch.device(DEVICE)) and record["param_devices"] == [
        torch.device(DEVICE).type
    ]
    assert _close(record["losses"], record["reference"])


@pytest.mark.system
@pytest.mark.timeout(120)
def test_more_workers_than_gpus_is_refused_before_anything_starts(tmp_path):
    if _gpus() == 0:
        pytest.skip("needs a GPU to count")
    done = _loom_run(tmp_path, "-n", str(_gpus() + 1), str(WORKERS / "gpu_train.py"), "dp", "2", timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert f"{_gpus() + 1} processes on this host but {_gpus()} GPU(s)" in done.stderr
    assert "--share-gpus" in done.stderr and "--device cpu" in done.stderr


def _shared_gpu_run(tmp_path: Path, processes: int, name: str, *extra: str) -> None:
    """``loom run -n PROCESSES --share-gpus EXTRA gpu_train.py NAME 6``: every rank on ``cuda:0`` (its parameters
    too) with the one-process CPU losses."""
    done = _loom_run(tmp_path, "-n", str(processes), "--share-gpus", *extra, str(WORKERS / "gpu_train.py"), name,
                     "6", timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(done.stdout)
    assert [r["rank"] for r in records] == list(range(processes))
    reference = records[0]["reference"]
    for r in records:
        assert r["device"] == str(torch.device(DEVICE).type + (":0" if DEVICE != "cpu" else ""))
        assert r["param_devices"] == [torch.device(DEVICE).type]  # the parameter server's worker's model too
        assert _close(r["losses"], reference), (name, r["rank"], r["losses"], reference)


@pytest.mark.system
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["dp", "localsgd", "tp", "ps"])
def test_two_processes_sharing_one_gpu_match_one_process_on_the_cpu(tmp_path, name):
    _shared_gpu_run(tmp_path, 2, name, *(["--servers", "1"] if name == "ps" else []))


@pytest.mark.system
@pytest.mark.timeout(400)
def test_hybrid_dp2_tp2_on_four_processes_sharing_one_gpu_matches_one_process(tmp_path):
    _shared_gpu_run(tmp_path, 4, "hybrid")


@pytest.mark.system
@pytest.mark.timeout(400)
def test_healing_data_parallel_on_a_shared_gpu_matches_one_process(tmp_path):
    _shared_gpu_run(tmp_path, 2, "dp", "--on-worker-failure", "heal")


@pytest.mark.system
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["pipeline", "sharded"])
def test_strategies_that_cannot_share_a_gpu_are_refused_by_name(tmp_path, name):
    if DEVICE == "cpu":
        pytest.skip("no GPU to share on the dry run")
    done = _loom_run(tmp_path, "-n", "2", "--share-gpus", str(WORKERS / "gpu_train.py"), name, "2")
    assert done.returncode != 0
    strategy = {"pipeline": "Pipeline", "sharded": "ShardedDataParallel"}[name]
    assert f"{strategy} cannot run with GPUs shared between processes (--share-gpus)" in done.stderr


@pytest.mark.system
@pytest.mark.timeout(300)
def test_cpu_training_on_a_gpu_host_with_device_cpu(tmp_path):
    done = _loom_run(tmp_path, "-n", "2", "--device", "cpu", str(WORKERS / "gpu_train.py"), "dp", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(done.stdout)
    assert all(r["device"] == "cpu" and r["param_devices"] == ["cpu"] for r in records)
    assert _close(records[0]["losses"], records[0]["reference"])
