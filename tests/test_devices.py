"""The device rule (`loom.devices`), on a CPU machine: GPUs are simulated by patching what torch reports, so the
choices, refusals and messages are checked here; the GPU lane (tests/test_gpu.py) checks the real thing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loom
from loom import devices
from loom.devices import DeviceChoice, check_gpu_count, choose_device, place_model

pytestmark = pytest.mark.unit


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("LOOM_DEVICE", raising=False)
    monkeypatch.delenv("LOOM_SHARE_GPUS", raising=False)


def test_without_a_gpu_every_process_trains_on_the_cpu_over_gloo(monkeypatch):
    _gpus(monkeypatch, 0)
    assert choose_device(None, 0, 1) == DeviceChoice("cpu", "gloo")
    assert choose_device("auto", 3, 4) == DeviceChoice("cpu", "gloo")
    with pytest.raises(ValueError, match="device 'cuda' was asked for, but this process sees no GPU"):
        choose_device("cuda", 0, 1)


def test_with_gpus_local_rank_k_trains_on_cuda_k_one_process_included(monkeypatch):
    _gpus(monkeypatch, 4)
    assert choose_device(None, 0, 1) == DeviceChoice("cuda:0", "cpu:gloo,cuda:nccl")
    assert choose_device(None, 2, 4) == DeviceChoice("cuda:2", "cpu:gloo,cuda:nccl")
    assert choose_device("cuda:3", 1, 2).device == "cuda:1"  # the rule picks the GPU from the local rank
    assert choose_device("cpu", 2, 4) == DeviceChoice("cpu", "gloo")  # the user's word wins
    monkeypatch.setenv("LOOM_DEVICE", "cpu")  # `loom run --device cpu`
    assert choose_device(None, 0, 1).device == "cpu"


def test_more_processes_than_gpus_are_refused_naming_counts_and_fixes_unless_shared(monkeypatch):
    _gpus(monkeypatch, 1)
    with pytest.raises(ValueError) as refused:
        choose_device(None, 1, 2)
    message = str(refused.value)
    assert "2 processes on this host but 1 GPU(s)" in message
    assert "`loom run -n 1`" in message and "--device cpu" in message and "--share-gpus" in message
    monkeypatch.setenv("LOOM_SHARE_GPUS", "1")
    assert choose_device(None, 1, 2) == DeviceChoice("cuda:0", "gloo", shared_gpu=True)
    assert choose_device(None, 3, 4).device == "cuda:0"


def test_the_launcher_refuses_before_anything_starts(monkeypatch):
    check_gpu_count(8, gpus=0)  # no GPU: the CPU rule, nothing to refuse
    check_gpu_count(2, gpus=2)
    check_gpu_count(8, "cpu", gpus=1)
    with pytest.raises(ValueError, match="8 processes on this host but 1 GPU"):
        check_gpu_count(8, gpus=1)
    with pytest.raises(ValueError, match="--device cuda, but this host has no GPU"):
        check_gpu_count(1, "cuda", gpus=0)
    monkeypatch.setenv("LOOM_SHARE_GPUS", "1")
    check_gpu_count(8, gpus=1)


def test_bad_device_values_are_named():
    with pytest.raises(ValueError, match=r"device='tpu' is not a device loom trains on"):
        choose_device("tpu", 0, 1)


def test_bad_device_variables_are_named(monkeypatch):
    monkeypatch.setenv("LOOM_DEVICE", "gpu")
    with pytest.raises(ValueError, match=r"LOOM_DEVICE='gpu': expected one of auto, cpu, cuda"):
        choose_device(None, 0, 1)
    monkeypatch.setenv("LOOM_DEVICE", "cpu")
    monkeypatch.setenv("LOOM_SHARE_GPUS", "yes")
    with pytest.raises(ValueError, match="LOOM_SHARE_GPUS='yes': expected 0 or 1"):
        check_gpu_count(2, gpus=1)


def test_a_cpu_build_counts_no_gpu_without_touching_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: pytest.fail("CUDA was asked"))
    assert devices.visible_gpus() == 0


def test_loom_run_refuses_minus_n_above_the_gpus_with_one_line(monkeypatch, capsys):
    from loom import cli

    monkeypatch.setattr(devices, "visible_gpus", lambda: 1)
    monkeypatch.delenv("LOOM_DEVICE", raising=False)  # auto
    assert cli.main(["run", "-n", "4", "train.py"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "loom run: 4 processes on this host but 1 GPU(s): NCCL gives each process its own GPU. HINT: "
        "`loom run -n 1`, or `--device cpu` to train on the CPU, or `--share-gpus` to put several processes on one "
        "GPU (collectives over gloo)"
    )
    assert cli.main(["run", "-n", "4", "--device", "cpu", "no_such_script.py"]) == 2  # (LOOM_DEVICE restored)
    assert "GPU" not in capsys.readouterr().err  # refused for the missing script, not for the GPUs


def test_a_model_on_the_jobs_device_is_left_where_it_is_silently(capsys):
    model = nn.Linear(2, 2)
    weight = model.weight
    place_model(model, torch.device("cpu"))
    assert model.weight is weight and capsys.readouterr().err == ""


def test_a_one_process_job_on_a_cpu_machine_trains_on_the_cpu():
    topo = loom.topology.current()
    assert topo.device == torch.device("cpu") and topo.device_name == "cpu" and not topo.shared_gpu
    assert loom.Topology(0, 1, 0, 1, "none").device == torch.device("cpu")
    assert loom.Topology(0, 2, 0, 2, "nccl", "cuda:1").device == torch.device("cuda", 1)
