"""A strategy's options: its config object or keyword arguments, and the options it refuses by name."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["NO_OBSERVER", "config_from", "refuse_options"]

C = TypeVar("C")


def config_from(config_type: type[C], config: C | None, options: Mapping[str, Any], strategy: str) -> C:
    """The strategy's config: ``config`` (an instance of ``config_type``) or one built from keyword
    ``options``; both at once, or a config of another type, is refused (it would leave one of them unread)."""
    if config is None:
        known = {f.name for f in dataclasses.fields(config_type)}  # type: ignore[arg-type]
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"{strategy} does not take {', '.join(map(repr, unknown))}. Its options: {', '.join(sorted(known))} "
                f"(see {config_type.__name__}). HINT: check the spelling, or use a strategy that takes it."
            )
        return config_type(**options)
    if not isinstance(config, config_type):
        raise TypeError(
            f"{strategy}(config) takes a {config_type.__name__}, got {type(config).__name__}. HINT: "
            f"{strategy}({config_type.__name__}(...)) or {strategy}(option=value, ...)."
        )
    if options:
        raise ValueError(
            f"{strategy} got a {config_type.__name__} and the options {sorted(options)} as well. HINT: put "
            f"them in the config: dataclasses.replace(config, {', '.join(f'{k}=...' for k in options)})."
        )
    return config


NO_OBSERVER = {"observe": "its job keeps no step observer to turn off; drop observe="}
"""What `refuse_options` says of ``observe=`` to a strategy without a step observer (gossip, parameter servers,
model parallelism)."""


def refuse_options(given: Mapping[str, Any], refused: Mapping[str, str], strategy: str) -> None:
    """Raise ``ValueError`` naming every option of ``given`` that ``strategy`` cannot honour.

    ``refused`` maps such an option to what to use instead (the strategies that honour it, or this strategy's
    own equivalent). An option is refused whenever it is passed, whatever its value: accepted and ignored, it
    would silently mean something other than what the user wrote."""
    bad = [name for name in given if name in refused]
    if bad:
        reasons = "; ".join(f"{name}: {refused[name]}" for name in bad)
        raise ValueError(f"{strategy} does not take {', '.join(bad)} ({reasons}).")
