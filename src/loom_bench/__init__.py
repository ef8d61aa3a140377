"""loom's benchmarks, kept apart from the library they measure: ``loom`` imports nothing from here.

``loom bench dp|allreduce|checkpoint|links`` (the CLI) and ``python -m loom_bench.<module>`` run them; every
figure is a ratio to a named baseline measured in the same run, written to ``benchmarks/reports``.
"""
