"""The device rule: which device a process trains on, and which process-group backend serves it.

The rule, its examples and what the GPU lane checks: docs/gpu.md. A process with a GPU trains on
``cuda:LOCAL_RANK``, else on the CPU; ``loom.init(device=...)`` or ``loom run --device`` (``LOOM_DEVICE``)
overrides it, and an explicit ``cuda`` where there is none is an error. More processes on a host than its GPUs is
refused before anything starts (`check_gpu_count` in the launcher, `choose_device` in each process for other
launchers), unless GPUs are shared on purpose (``--share-gpus``, ``LOOM_SHARE_GPUS=1``): local rank ``r`` then
trains on ``cuda:(r mod G)`` and collectives run over gloo, which carries CUDA tensors for all_reduce, broadcast
and all_gather (NCCL refuses two ranks on one GPU); strategies that send point to point refuse a shared GPU
(`refuse_shared_gpu`).

A job on its own GPUs uses ``cpu:gloo,cuda:nccl``: CUDA tensors over NCCL, loom's control collectives on CPU
tensors (flags, same-data checks, the watchdog) over gloo, in one default group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from loom.settings import setting

__all__ = [
    "DeviceChoice",
    "choose_device",
    "check_gpu_count",
    "visible_gpus",
    "place_model",
    "refuse_shared_gpu",
]

DEVICE_CHOICES = ("auto", "cpu", "cuda")
MIXED_BACKEND = "cpu:gloo,cuda:nccl"


@dataclass(frozen=True)
class DeviceChoice:
    """Where this process trains and over what its job's collectives run."""

    device: str
    """``"cpu"`` or ``"cuda:K"``."""
    backend: str
    """The process-group backend for a job of several processes: ``gloo``, or ``cpu:gloo,cuda:nccl``."""
    shared_gpu: bool = False
    """True when several local ranks train on one GPU (``--share-gpus``): gloo carries the CUDA tensors."""


def requested_device(device: str | None = None) -> str:
    """``device`` (``loom.init(device=...)``), else ``LOOM_DEVICE`` (``loom run --device``), else ``auto``;
    ``cuda:K`` is accepted as ``cuda`` (the rule picks K from the local rank). Raises `ValueError` naming the
    value and the choices."""
    if device is None:
        return str(setting("LOOM_DEVICE"))  # checked where it is declared (loom.settings)
    name = str(device).split(":")[0]
    if name not in DEVICE_CHOICES:
        raise ValueError(
            f"device={device!r} is not a device loom trains on. HINT: use one of {DEVICE_CHOICES}"
        )
    return name


def _too_many(nproc: int, gpus: int) -> str:
    return (
        f"{nproc} processes on this host but {gpus} GPU(s): NCCL gives each process its own GPU. HINT: "
        f"`loom run -n {gpus}`, or `--device cpu` to train on the CPU, or `--share-gpus` to put several processes "
        "on one GPU (collectives over gloo)"
    )


def choose_device(device: str | None, local_rank: int, local_world_size: int) -> DeviceChoice:
    """The device rule (module docstring) for local rank ``local_rank`` of ``local_world_size`` on this host."""
    name = requested_device(device)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return DeviceChoice("cpu", "gloo")
    if not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' was asked for, but this process sees no GPU (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}). HINT: install a CUDA build of torch, check CUDA_VISIBLE_DEVICES, or "
            "use --device cpu"
        )
    gpus = torch.cuda.device_count()
    if local_world_size > gpus:
        if not setting("LOOM_SHARE_GPUS"):  # (loom run --share-gpus)
            raise ValueError(_too_many(local_world_size, gpus))
        return DeviceChoice(f"cuda:{local_rank % gpus}", "gloo", shared_gpu=True)
    return DeviceChoice(f"cuda:{local_rank}", MIXED_BACKEND)


def visible_gpus() -> int:
    """GPUs this host's processes will see, counted without initializing CUDA in this process (the launcher
    forks its workers from a zygote: a CUDA context made before a fork is unusable after it). A CPU build of torch
    answers 0 at once; a CUDA build asks NVML (honouring CUDA_VISIBLE_DEVICES), else a child process."""
    if torch.version.cuda is None:
        return 0
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia")):
        return 0  # a CUDA build on a host without NVIDIA's driver (PyPI's default torch on a CPU machine)
    nvml = getattr(torch.cuda, "_device_count_nvml", None)
    count = nvml() if nvml is not None else -1
    if count >= 0:
        return int(count)
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


def check_gpu_count(nproc: int, device: str | None = None, gpus: int | None = None) -> None:
    """Refuse, before anything starts, ``nproc`` processes on a host with fewer GPUs (unless shared), and
    ``--device cuda`` on a host without one. `ValueError` with the counts and the fixes."""
    name, shared = requested_device(device), setting("LOOM_SHARE_GPUS")  # both checked, whatever the device
    if name == "cpu":
        return
    count = visible_gpus() if gpus is None else gpus
    if count == 0:
        if name == "cuda":
            raise ValueError("--device cuda, but this host has no GPU that torch can use. HINT: --device cpu")
        return
    if nproc > count and not shared:
        raise ValueError(_too_many(nproc, count))


def refuse_shared_gpu(
    strategy: str, topology, why: str = "its stages exchange point-to-point messages"
) -> None:
    """Strategies that send tensors rank to rank cannot run with GPUs shared over gloo (a gloo send of a CUDA
    tensor aborts the process): refused by name."""
    if getattr(topology, "shared_gpu", False):
        raise ValueError(
            f"{strategy} cannot run with GPUs shared between processes (--share-gpus): {why}, and gloo cannot "
            "send CUDA tensors. HINT: one process per GPU (`loom run -n <GPUs>`), or --device cpu"
        )


def place_model(model: torch.nn.Module, device: torch.device, optimizer=None, rank: int = 0) -> None:
    """Put ``model`` (and ``optimizer``'s state) on the job's ``device``: nothing happens when it is there
    already; otherwise it is moved, and rank 0 says so in one line (a model on the wrong device is either a
    deliberate choice the user should override with ``loom.init(device=...)``, or a slow surprise)."""
    places = {t.device for t in (*model.parameters(), *model.buffers())}
    if not places or places == {device}:
        return
    model.to(device)  # in place: the optimizer's parameters are the same objects, now on ``device``
    if optimizer is not None and optimizer.state:  # torch's rule moves each state to its param's device
        optimizer.load_state_dict(optimizer.state_dict())
    if rank == 0:
        was = ", ".join(sorted(str(p) for p in places))
        print(
            f"loom: the model was on {was}; this job trains on {device}, so it was moved there "
            "(loom.init(device=...) or `loom run --device` chooses the device)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
