"""The data family of strategies (see `loom.parallel`)."""
