"""The guard's three timeouts, each resolved once: the argument given, else its environment variable, else its
default (`loom.settings` declares and checks the variables). The hang and work timeouts are the watchdog's
(`loom.fault.watchdog`), the liveness timeout its heartbeats' (`loom.fault.liveness`)."""

from __future__ import annotations

from loom.settings import SETTINGS, setting

__all__ = [
    "DEFAULT_LIVENESS_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "hang_timeout_s",
    "liveness_timeout_s",
    "seconds_setting",
    "work_timeout_s",
]

DEFAULT_TIMEOUT_S: float = SETTINGS["LOOM_HANG_TIMEOUT_S"].default
"""How long every rank may sit inside collectives with none completing (nothing can still arrive): minutes, below
the process group's timeout, so that loom's report comes before gloo's bare error."""
DEFAULT_LIVENESS_TIMEOUT_S: float = SETTINGS["LOOM_LIVENESS_TIMEOUT_S"].default
"""How long a peer's heartbeat may stay still before it is lost: many polls of slack for a busy host, far below
any hang timeout worth having."""


def seconds_setting(requested: float | None, variable: str, what: str) -> float:
    """``requested``, else the environment ``variable``, else its default: a positive number of seconds."""
    if requested is None:
        requested = setting(variable)  # (checked where it is declared, `loom.settings`)
    if isinstance(requested, bool) or not float(requested) > 0:
        raise ValueError(
            f"the {what} must be a positive number of seconds, got {requested!r}. HINT: pass seconds, or leave it "
            f"None to use {variable} (default {SETTINGS[variable].default:g} s)"
        )
    return float(requested)


def hang_timeout_s(requested: float | None = None) -> float:
    """The timeout to use: ``requested``, else ``LOOM_HANG_TIMEOUT_S``, else `DEFAULT_TIMEOUT_S`."""
    return seconds_setting(requested, "LOOM_HANG_TIMEOUT_S", "hang timeout")


def work_timeout_s(requested: float | None = None) -> float:
    """The work timeout: ``requested``, else ``LOOM_WORK_TIMEOUT_S``, else its default (gloo's, 30 minutes)."""
    return seconds_setting(requested, "LOOM_WORK_TIMEOUT_S", "work timeout")


def liveness_timeout_s(requested: float | None = None) -> float:
    """The liveness timeout: ``requested``, else ``LOOM_LIVENESS_TIMEOUT_S``, else `DEFAULT_LIVENESS_TIMEOUT_S`."""
    return seconds_setting(requested, "LOOM_LIVENESS_TIMEOUT_S", "liveness timeout")
