"""The pipeline family of strategies (see `loom.parallel`)."""
