"""What every strategy's training step shares, written once: its guard (`loom.train.guard`) and the handling of
its options (`loom.train.options`)."""

from loom.train.guard import GuardOptions, StepGuard
from loom.train.options import config_from, refuse_options

__all__ = ["GuardOptions", "StepGuard", "config_from", "refuse_options"]
