"""The ps family of strategies (see `loom.parallel`)."""
