"""``loom.spark.run``: a loom training function or script on Spark barrier tasks (the launcher itself is
`loom.launch.spark`, beside loom's other launchers; this module keeps the documented name ``import loom.spark``)."""

from loom.launch.spark import run

__all__ = ["run"]
