"""The model family of strategies (see `loom.parallel`)."""
