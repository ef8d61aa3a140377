"""The replica family of strategies (see `loom.parallel`)."""
