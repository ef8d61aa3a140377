"""Launching: processes, hosts and restarts (knows no model)."""
