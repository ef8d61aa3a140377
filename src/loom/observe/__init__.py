"""Observability: what each process records per step."""

from loom.observe.metrics import StepMetrics, StepRecord

__all__ = ["StepMetrics", "StepRecord"]
