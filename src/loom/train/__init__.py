"""What every strategy's training step shares, written once: the step engine (`loom.train.engine`), its guard
(`loom.train.guard`) and the handling of its options (`loom.train.options`); and `loom.fit` (`loom.train.fit`)."""
