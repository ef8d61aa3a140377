"""``loom plan``: which strategy should you choose? Predicted step time, samples/s, memory per process and bytes
on the wire of every configuration, for the user's own model, from a few measured steps; ``--verify`` checks the
top ones against real runs.

`capture` (the script's model, optimizer, loss and data), `profile` (per-layer times and bytes), `transport`
(collectives as loom runs them), `configs` (what is compared), `cost` (the formulas), `recommend` (ranking, reasons,
JSON), `planner` (the order), `trial` (the multi-process measurements), `command` (the CLI). See ``docs/plan.md``.
The names below are imported on first use, so ``loom plan --help`` imports no torch.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loom.plan.planner import PlanError, PlanResult, Verification, plan, verify

__all__ = ["PlanError", "PlanResult", "Verification", "plan", "verify"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from loom.plan import planner

        return getattr(planner, name)
    raise AttributeError(f"module 'loom.plan' has no attribute {name!r}")
