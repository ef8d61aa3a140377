"""The PNG figures of ``loom report``, drawn with matplotlib (no display needed: the Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

__all__ = ["FIGURES", "draw_figures"]

FIGURES = {
    "loss": "Loss per step",
    "throughput": "Throughput over time",
    "heatmap": "Step time per rank (stragglers)",
    "phases": "Where the time goes, per rank",
    "bytes": "Bytes moved per step",
}
"""Figure id -> title; the report's page shows them in this order (`draw_figures` returns them so)."""

_PHASE_COLORS = {"data": "#4c78a8", "compute": "#59a14f", "comm": "#e15759", "optimizer": "#f28e2b"}


def draw_figures(runs: dict[int, list[dict[str, Any]]], out_dir: Path) -> dict[str, Path]:
    """Write one PNG per entry of `FIGURES` into ``out_dir``; returns id -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    draw = {"loss": _loss, "throughput": _throughput, "heatmap": _heatmap, "phases": _phases, "bytes": _bytes}
    paths = {}
    for name, fn in draw.items():
        fig = fn(runs)
        fig.suptitle(FIGURES[name], fontsize=11)
        fig.tight_layout()
        paths[name] = out_dir / f"{name}.png"
        fig.savefig(paths[name], dpi=110)
        plt.close(fig)
    return paths


def _loss(runs):
    recs = runs[min(runs)]  # the first rank's: the loss is the global batch's, the same on every rank
    fig, ax = plt.subplots(figsize=(7, 3.2))
    steps = [r["step"] for r in recs]
    losses = [r["loss"] for r in recs]
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="global-batch loss")
    k = max(1, len(losses) // 20)
    windows = (losses[max(0, i - k + 1) : i + 1] for i in range(len(losses)))
    smooth = [sum(w) / len(w) for w in windows]
    ax.plot(steps, smooth, lw=1.6, label=f"mean of last {k} steps")
    ax.set(xlabel="step", ylabel="loss")
    ax.legend(fontsize=8)
    return fig


def _throughput(runs):
    recs = runs[min(runs)]
    t0 = recs[0]["wall"] - recs[0]["time_s"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = [r["wall"] - t0 for r in recs]
    ys = [r["global_samples"] / r["time_s"] if r["time_s"] else 0.0 for r in recs]
    ax.plot(xs, ys, lw=0.8, marker=".", ms=2)
    ax.set(xlabel="seconds since the first step started", ylabel="samples/s (global batch)", ylim=(0, None))
    return fig


def _matrix(runs, key):
    steps = sorted({r["step"] for recs in runs.values() for r in recs})
    index = {s: i for i, s in enumerate(steps)}
    grid = [[float("nan")] * len(steps) for _ in runs]
    for row, rank in enumerate(sorted(runs)):
        for r in runs[rank]:
            grid[row][index[r["step"]]] = key(r) * 1e3
    return steps, grid


def _heatmap(runs):
    ranks = sorted(runs)
    fig, axes = plt.subplots(2, 1, figsize=(7, 1.6 + 0.5 * len(ranks) * 2), sharex=True)
    panels = (
        ("step time (ms)", lambda r: r["time_s"]),
        ("busy time = step - comm wait (ms)", lambda r: r["time_s"] - (r.get("comm_s") or 0.0)),
    )
    for ax, (label, key) in zip(axes, panels, strict=True):
        steps, grid = _matrix(runs, key)
        values = sorted(v for row in grid for v in row if v == v)  # v == v drops NaN
        vmax = values[int(0.98 * (len(values) - 1))] if values else None  # warm-up outliers would wash it out
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma", vmax=vmax,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, len(ranks) - 0.5, -0.5))  # fmt: skip
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.set_title(label, fontsize=9)
        fig.colorbar(image, ax=ax)
    axes[-1].set_xlabel("step")
    return fig


def _phases(runs):
    ranks = sorted(runs)
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.45 * len(ranks)))
    left = [0.0] * len(ranks)
    timed = [runs[rank][1:] or runs[rank] for rank in ranks]
    for phase, color in _PHASE_COLORS.items():
        means = [1e3 * sum(r.get(f"{phase}_s") or 0.0 for r in recs) / max(len(recs), 1) for recs in timed]
        ax.barh([f"rank {r}" for r in ranks], means, left=left, color=color, label=phase)
        left = [a + b for a, b in zip(left, means, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("mean ms per step (first step excluded)")
    ax.legend(ncol=4, fontsize=8, loc="lower right")
    return fig


def _bytes(runs):
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for rank in sorted(runs):
        steps = [r["step"] for r in runs[rank]]
        for way, ls in (("sent", "-"), ("received", "--")):
            megabytes = [(r.get(f"bytes_{way}") or 0) / 1e6 for r in runs[rank]]
            ax.plot(steps, megabytes, lw=1, ls=ls, label=f"rank {rank} {way}")
    ax.set(xlabel="step", ylabel="MB per step", ylim=(0, None))
    ax.legend(fontsize=7, ncol=2)
    return fig
