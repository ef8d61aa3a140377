"""The gossip family of strategies (see `loom.parallel`)."""
