"""The tensor family of strategies (see `loom.parallel`)."""
