"""One process on one GPU: loom's step against the plain PyTorch loop on the same GPU (issue 35's 2 % target).

``python -m loom_bench.gpu_step [--out DIR] [--reps 5] [--steps 50]`` on a machine with CUDA. For each model
(an MLP of ~100 M parameters whose step takes >= 5 ms on a recent GPU, and a ~4 M one of about 1 ms), alternating
within each repetition, the same batches, float32, Adam:

- ``plain``: ``zero_grad``, forward, ``mse_loss``, backward, ``step``: what a user writes without loom;
- ``plain+verdict``: the same with one ``torch.isfinite(loss).item()`` per step (the GPU stall a non-finite
  verdict costs, measured alone);
- ``loom``: ``loom.DataParallel().setup(...)`` and ``job.train_step(batch)`` over ``job.loader``;
- ``loom.fit``: ``loom.fit(job, loader, steps=..., progress=False)`` (no checkpoints).

The plain loop takes its batches from a ``DataLoader`` over the same CPU tensors, moved with ``.to(device)`` as
loom's loader does. Each variant's time per step is the wall time of ``--steps`` steps after 10 warm-up steps,
the GPU synchronized before and after; the report gives medians over repetitions and each variant's paired
ratio to ``plain`` (the median of per-repetition ratios). Writes ``gpu_step.md`` and ``gpu_step.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import loom

MODELS = {"100m": (5120, 4), "4m": (1024, 4)}
"""name -> (width, layers): Linear(width, width) x layers with ReLU between."""
BATCH = 256


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    parts: list[nn.Module] = []
    for i in range(layers):
        parts.append(nn.Linear(width, width))
        if i < layers - 1:
            parts.append(nn.ReLU())
    return nn.Sequential(*parts).cuda()


def _data(width: int, steps: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = BATCH * (steps + 10)
    return torch.utils.data.TensorDataset(
        torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)
    )


def _timed(run: Callable[[int], None], steps: int) -> float:
    run(10)  # warm-up: allocator, cuBLAS handles, Adam's state
    torch.cuda.synchronize()
    start = time.perf_counter()
    run(steps)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _plain(width: int, layers: int, steps: int, verdict: bool) -> float:
    model = _model(width, layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(_data(width, steps), batch_size=BATCH, shuffle=True)

    def run(n: int) -> None:
        it = iter(loader)
        for _ in range(n):
            x, y = next(it)
            x, y = x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if verdict and not bool(torch.isfinite(loss).item()):
                continue
            optimizer.step()

    return _timed(run, steps)


def _loom(width: int, layers: int, steps: int, fit: bool) -> float:
    model = _model(width, layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    job = loom.DataParallel().setup(model, optimizer, nn.functional.mse_loss)
    loader = job.loader(_data(width, steps), global_batch_size=BATCH, seed=0)

    def run(n: int) -> None:
        if fit:
            loom.fit(job, loader, steps=job.step + n, progress=False)
            return
        it = iter(loader)
        for _ in range(n):
            job.train_step(next(it))

    return _timed(run, steps)


VARIANTS: dict[str, Callable[[int, int, int], float]] = {
    "plain": lambda w, k, s: _plain(w, k, s, verdict=False),
    "plain+verdict": lambda w, k, s: _plain(w, k, s, verdict=True),
    "loom": lambda w, k, s: _loom(w, k, s, fit=False),
    "loom.fit": lambda w, k, s: _loom(w, k, s, fit=True),
}


def measure(reps: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per step, per model and variant, one list entry per repetition (variants alternate)."""
    times: dict[str, dict[str, list[float]]] = {m: {v: [] for v in VARIANTS} for m in MODELS}
    for rep in range(reps):
        for model, (width, layers) in MODELS.items():
            order = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                times[model][variant].append(VARIANTS[variant](width, layers, steps))
                torch.cuda.empty_cache()
    return times


def report(times: dict[str, dict[str, list[float]]], command: str) -> str:
    props = torch.cuda.get_device_properties(0)
    lines = [
        "# One process on one GPU: loom's step vs the plain PyTorch loop",
        "",
        f"Device: {props.name}; torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL "
        f"{'.'.join(map(str, torch.cuda.nccl.version()))}; command: `{command}`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| model | variant | ms/step (median) | paired ratio to plain |",
        "|---|---|---|---|",
    ]
    for model, variants in times.items():
        base = variants["plain"]
        for variant, values in variants.items():
            ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
            lines.append(f"| {model} | {variant} | {1e3 * statistics.median(values):.3f} | {ratio:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("loom_bench.gpu_step needs a CUDA device")
    times = measure(ns.reps, ns.steps)
    ns.out.mkdir(parents=True, exist_ok=True)
    command = f"python -m loom_bench.gpu_step --reps {ns.reps} --steps {ns.steps}"
    (ns.out / "gpu_step.json").write_text(json.dumps(times, indent=1))
    text = report(times, command)
    (ns.out / "gpu_step.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
