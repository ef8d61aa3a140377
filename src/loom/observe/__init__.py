"""Observability: what each process records per step, straggler warnings, traces and ``loom report``.

`loom.observe.metrics` (the records), `loom.observe.phases` (how a step is timed), `loom.observe.stragglers`,
`loom.observe.trace` (Chrome-trace timeline), `loom.observe.report` (HTML + PNG report),
`loom_bench.metrics_overhead` (what all of it costs).
"""

from loom.observe.metrics import StepMetrics, StepRecord
from loom.observe.phases import StepObserver
from loom.observe.stragglers import StragglerConfig, StragglerDetector, StragglerWarning

__all__ = [
    "StepMetrics",
    "StepObserver",
    "StepRecord",
    "StragglerConfig",
    "StragglerDetector",
    "StragglerWarning",
]
