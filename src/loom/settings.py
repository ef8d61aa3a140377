"""Every ``LOOM_*`` environment variable loom reads, declared once: its name, type, bounds, default and meaning
(the table: docs/settings.md).

The library reads a setting with `setting`, which parses and checks it here (a bad value is one line naming the
variable, its value and the fix), and ``loom run`` checks every user setting with `check_environment` before it
starts anything (exit 2): one declaration for both, so they cannot disagree, and a value no worker would accept
never costs a start. ``tests/test_settings.py`` checks that every ``LOOM_`` name in the sources is declared here.
Settings marked ``internal`` are how ``loom run`` (or a test, a benchmark) talks to the processes it starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from loom.errors import SettingError

__all__ = ["SETTINGS", "Setting", "SettingError", "check_environment", "setting"]

_LONGEST_S = 30 * 86400.0
"""The longest time any setting may name (30 days): longer is a typo, and overflows some waits."""


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``parse`` turns its text into the value (raising ValueError with what it
    expects); ``default`` is the value when it is unset or empty."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    internal: bool = False

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        raw = (os.environ if environ is None else environ).get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as error:
            shown = "<hidden>" if "SECRET" in self.name else repr(raw)
            raise SettingError(f"{self.name}={shown}: {error}. HINT: {self.doc}; unset it for the default"
                               + (f" ({self.default:g})" if isinstance(self.default, float) else "")) from None  # fmt: skip


def _seconds(zero: bool = False) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("not a number of seconds") from None
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0) and value <= _LONGEST_S):
            raise ValueError(f"expected seconds {'>=' if zero else '>'} 0 and <= {_LONGEST_S:g}")
        return value

    return parse


def _number(low: float, high: float) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("not a number") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"expected a number in {low:g}..{high:g}")
        return value

    return parse


def _integer(low: int, high: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        if not raw.lstrip("-").isdigit() or not low <= int(raw) <= high:
            raise ValueError(f"expected an integer in {low}..{high}")
        return int(raw)

    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return raw

    return parse


def _flag(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return raw == "1"


def _text(raw: str) -> str:
    if len(raw) > 4096 or "\0" in raw:
        raise ValueError("expected text of at most 4096 characters")
    return raw


def _steps(raw: str) -> str:
    first, sep, last = raw.partition(":")
    if not (sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise ValueError("expected FIRST:LAST steps with 1 <= FIRST <= LAST")
    return raw


_DECLARED = [
    # ---- timeouts of a job (every worker, and the launcher that supervises it)
    Setting("LOOM_HANG_TIMEOUT_S", _seconds(), 180.0, "seconds a collective may wait before the watchdog stops "
            "the job naming the late rank(s)"),
    Setting("LOOM_WORK_TIMEOUT_S", _seconds(), 1800.0, "seconds the others wait for a rank doing its own work "
            "(evaluation, a checkpoint) before the job stops naming it"),
    Setting("LOOM_LIVENESS_TIMEOUT_S", _seconds(), 20.0, "seconds without a peer's heartbeat before it counts as "
            "lost"),
    Setting("LOOM_JOIN_TIMEOUT_S", _seconds(), 120.0, "seconds a worker waits for every rank to join"),
    Setting("LOOM_HEAL_HEARTBEAT_TIMEOUT_S", _seconds(), 10.0, "seconds without a member's heartbeat before the "
            "healing launcher drops and replaces it"),
    Setting("LOOM_HEAL_CHECKIN_TIMEOUT_S", _seconds(), 10.0, "seconds the healing launcher waits for every live "
            "member to check in to a new epoch"),
    Setting("LOOM_HEAL_GROUP_TIMEOUT_S", _seconds(), 30.0, "seconds each collective of a healing epoch's group "
            "may take"),
    Setting("LOOM_HEAL_VOTE_TIMEOUT_S", _seconds(), 30.0, "seconds a member waits for a step's commit vote"),
    Setting("LOOM_HEAL_EPOCH_TIMEOUT_S", _seconds(), 120.0, "seconds a member waits for the next membership "
            "epoch"),
    Setting("LOOM_HEAL_JOIN_WAIT_S", _seconds(zero=True), 2.0, "seconds the members wait for a replacement that "
            "is about to join before going on without it (0: not at all)"),
    Setting("LOOM_HEAL_STUCK_REPEATS", _integer(1, 1000), 2, "how many times the same member may be replaced for "
            "hanging at the same place before the job stops naming it"),
    # ---- where a job trains (loom.devices)
    Setting("LOOM_DEVICE", _choice("auto", "cpu", "cuda"), "auto", "where workers train: auto (cuda:LOCAL_RANK "
            "where there is a GPU, else the CPU), cpu or cuda (loom run --device)"),
    Setting("LOOM_SHARE_GPUS", _flag, False, "1 lets more workers than GPUs share them, collectives over gloo "
            "(loom run --share-gpus)"),
    # ---- the launcher
    Setting("LOOM_ZYGOTE", _flag, True, "1 forks workers from one process that imported torch once, 0 starts "
            "each as a fresh interpreter"),
    Setting("LOOM_ZYGOTE_READY_S", _seconds(), 120.0, "seconds the launcher waits for its zygote to import torch "
            "and loom before starting every worker as a fresh interpreter instead"),
    Setting("LOOM_CLUSTER", _text, "", "a JSON cluster spec, a path or the JSON itself (loom run --cluster)"),
    Setting("LOOM_HOST_INDEX", _integer(0, 1 << 20), None, "this host's position in the cluster spec's hosts"),
    Setting("LOOM_RUN_ID", _text, "", "the job's id (default: derived from the master endpoint)"),
    Setting("LOOM_JOB_SECRET", _text, "", "the job secret, the same on every node (e.g. openssl rand -hex 32)"),
    Setting("LOOM_TRACE_STEPS", _steps, "", "FIRST:LAST, the steps whose timeline is traced (loom run "
            "--trace-steps)"),
    # ---- a worker's library
    Setting("LOOM_CACHE_DIR", _text, "", "a directory for loom's per-host calibration cache (default "
            "~/.cache/loom)"),
    Setting("LOOM_HOST_ID", _text, "", "a name for this host, for which ranks share memory (default: the boot "
            "id)"),
    Setting("LOOM_STRAGGLER_MARGIN", _number(0.0, 1e6), 0.2, "how much slower than the median a straggler is, "
            "as a fraction"),
    Setting("LOOM_STRAGGLER_WINDOW", _integer(1, 1 << 20), 10, "steps averaged before a straggler is named"),
    Setting("LOOM_STRAGGLER_MIN_MS", _number(0.0, 1e9), 2.0, "the least excess over the median, in ms, that "
            "names a straggler"),
    Setting("LOOM_HOROVOD_ALLREDUCE", _choice("native", "auto", "ring", "driver", "shm", "hierarchical"), "native", "the all-reduce "
            "algorithm of loom.horovod"),
    Setting("LOOM_HOROVOD_STATE_DIR", _text, "", "where loom.horovod's elastic state is kept"),
    Setting("LOOM_PS_CHECKPOINT_DIR", _text, "", "where parameter servers write their checkpoints"),
    # ---- fault injection (tests, benchmarks; free when unset)
    Setting("LOOM_FAULTS", _text, "", "faults to inject (tests and benchmarks; its form is checked by "
            "loom.fault.inject.parse_faults, which loom run calls before it starts)"),
    Setting("LOOM_FAULTS_SLOW_S", _seconds(zero=True), 3.0, "the pause of an injected 'slow' fault"),
    Setting("LOOM_TEST_ZYGOTE_DELAY_S", _seconds(zero=True), 0.0, "a test hook: seconds the zygote waits before "
            "it imports (a slow host)"),
    # ---- what loom run (or Ray, a test, a benchmark) tells the processes it starts
    *(Setting(name, _text, "", doc, internal=True) for name, doc in (
        ("LOOM_RUN_DIR", "the run directory (loom run --run-dir)"),
        ("LOOM_STORE_PREFIX", "the job's keys in the store"),
        ("LOOM_ON_WORKER_FAILURE", "the launcher's --on-worker-failure"),
        ("LOOM_HEAL_GENERATION", "a replacement's heal generation"),
        ("LOOM_PS_ADDRS", "the parameter servers' addresses"),
        ("LOOM_RAY_RESULT_FD", "the descriptor a Ray rank writes its result to"),
        ("LOOM_RAY_NODE_ADDRESS", "a Ray rank's node address"),
        ("LOOM_ZYGOTE_FD", "the zygote's end of its socket"),
        ("LOOM_ZYGOTE_ROOM", "room for a forked worker's environment in /proc"),
        ("LOOM_TEST_PORT_BASE", "a test run's port range"),
        ("LOOM_BENCH_TAG", "a benchmark run's tag"),
        ("LOOM_HEAL_DROPPED", "a benchmark's record of dropped ranks"),
    )),
]  # fmt: skip

SETTINGS: dict[str, Setting] = {s.name: s for s in _DECLARED}
"""Every setting, by name."""


def setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of ``name`` in ``environ`` (default: this process's environment), parsed and checked; raises
    `SettingError` (one line with a HINT) for a value loom refuses, KeyError for a name not declared here."""
    return SETTINGS[name].read(environ)


def check_environment(environ: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """The lines for ``environ``'s ``LOOM_*`` variables: errors (a user setting whose value loom refuses) and
    warnings (a name loom does not read: a typo that would silently change nothing)."""
    environ = os.environ if environ is None else environ
    errors, warnings = [], []
    for name in sorted(environ):
        if not name.startswith("LOOM_"):
            continue
        declared = SETTINGS.get(name)
        if declared is None:
            near = [k for k in SETTINGS if k.startswith(name[: max(6, len(name) - 4)])][:3]
            warnings.append(f"{name} is no setting loom reads; it changes nothing. HINT: " + (
                f"did you mean {', '.join(near)}?" if near else "docs/settings.md lists the LOOM_* variables"))  # fmt: skip
        elif not declared.internal:
            try:
                declared.read(environ)
            except SettingError as error:
                errors.append(str(error))
    return errors, warnings
