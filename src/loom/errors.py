"""Every error loom raises on purpose, in one place: ``except loom.errors.LoomError`` catches them all.

Each also derives from a built-in exception (``ValueError`` for bad input, ``RuntimeError`` for a failed job), so
code that catches those still does. Bad arguments to a function are plain ``ValueError`` / ``TypeError`` naming the
value and the fix; the classes here are the conditions a caller may want to tell apart. This module imports nothing
of loom's: every layer may raise these.

Retry-ability is declared, not guessed: every class states ``retryable`` (`LoomError.retryable`), which
`is_retryable` alone reads: healing retries a retryable error and stops the job on any other.
"""

from __future__ import annotations

import signal
from pathlib import Path


def failure_text(error: BaseException) -> str:
    """``Type: message``, with the errno of the first OS error in its chain named where the message does not
    already (``[ENOSPC, errno 28: No space left on device, on PATH]``): a failure line that reaches the launcher
    through several wrappers (an asynchronous checkpoint's thread, the ranks' agreement) keeps the cause a user
    can act on."""
    import errno as codes
    import os

    text = f"{type(error).__name__}: {error}"
    seen: BaseException | None = error
    for _ in range(10):  # (chains are short; a cycle must not loop)
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.errno:
            name = codes.errorcode.get(seen.errno, f"errno {seen.errno}")
            if name not in text:
                where = f", on {seen.filename}" if seen.filename else ""
                text += f" [{name}, errno {seen.errno}: {os.strerror(seen.errno)}{where}]"
            break
        seen = seen.__cause__ or seen.__context__
    return text


class LoomError(Exception):
    """The base of every error in this module."""

    retryable: bool = False
    """True: the same work can succeed when done again once the group has re-formed or restarted (a lost or slow
    peer, a dropped step); False: it would meet the same error (bad input, a refused or conflicting state, a bug).
    Each of loom's classes states it as a class keyword (``class StepDropped(LoomError, retryable=True)``); a
    user's subclass may omit it and inherits its base's."""

    def __init_subclass__(cls, *, retryable: bool | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if retryable is not None:
            cls.retryable = retryable


def is_retryable(error: BaseException) -> bool:
    """Whether healing retries a step (or an epoch's forming) that raised ``error``: loom's own errors say so
    (``retryable``); any other exception (torch's, gloo's, a socket's) is what a lost peer makes its survivors
    raise, so it is retried."""
    return error.retryable if isinstance(error, LoomError) else True


class HangError(LoomError, RuntimeError, retryable=True):
    """A collective waited longer than the hang timeout (recorded for the launcher; never raised)."""


class PeerLostError(LoomError, RuntimeError, retryable=True):
    """A host of the job stopped answering for longer than the liveness timeout (recorded for the launcher; never
    raised)."""


class ReplicaDesyncError(LoomError, RuntimeError, retryable=False):
    """Replicas that should be identical hold different parameters."""


class NonFiniteStepError(LoomError, FloatingPointError, retryable=False):
    """A step's loss or gradient was non-finite, under policy ``"stop"`` or too many steps in a row."""


class ModelMismatchError(LoomError, ValueError, retryable=False):
    """The model or optimizer is not the same on every process."""


class ClusterSpecError(LoomError, ValueError, retryable=False):
    """A malformed cluster spec; the message names the field and the fix."""


class CheckpointError(LoomError, RuntimeError, retryable=False):
    """A checkpoint could not be written or read."""


class CorruptCheckpointError(CheckpointError, retryable=False):
    """One checkpoint is damaged; ``path`` is the file (or directory) found wrong, ``reason`` says how."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class NoValidCheckpointError(CheckpointError, retryable=False):
    """Checkpoints exist in the directory, but none of them is intact."""


class NonFiniteStateError(CheckpointError, retryable=False):
    """The state to checkpoint holds NaN or infinite values: it is not written (the previous checkpoint stays)."""


class RayJobFailed(LoomError, RuntimeError, retryable=False):
    """A job on Ray failed after its replacements; the message names the rank and what happened to it."""


class JSONLimitError(LoomError, ValueError, retryable=False):
    """JSON that breaks one of the `loom.checkpoint.limits.ReadLimits`; ``field`` names it, so a message can say
    what to raise."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


# -- healing (`loom.fault.quorum`, `loom.parallel.data.data_axis`, `loom.train.heal_state`) ---------------------
class StepDropped(LoomError, RuntimeError, retryable=True):
    """The commit vote said drop: no member applied the step; it is retried by the next epoch's members."""


class EpochNotFormed(LoomError, RuntimeError, retryable=True):
    """A member of a membership epoch was lost, or did not arrive, while the members met to build the epoch's
    group (`loom.fault.quorum.Quorum._meet`): the others check in again for the next epoch."""


class LeftOutOfQuorum(LoomError, RuntimeError, retryable=False):
    """This worker was not in the epoch it waited for (too slow to check in): `loom.launch.worker` ends the
    process with ``exit_status``, not as an error, and the launcher replaces it (this process does not retry)."""

    exit_status = 75
    """sysexits' EX_TEMPFAIL, "try again": the launcher replaces the worker as it does a killed one."""


class JobEnded(LoomError, RuntimeError, retryable=False):
    """Another member finished the job (the launcher marked ``q/end``) while this one waited for an epoch to train
    another step: its loop runs more steps than theirs (e.g. a replacement's own loop counting epochs from 0)."""


class HealConflict(LoomError, RuntimeError, retryable=False):
    """The members of a new epoch claim committed steps more than one apart: copying the highest would spread
    whatever its claimant holds (`loom.parallel.data.data_axis.take_live_state`). The job stops, naming each
    claim."""


class DifferentBatches(LoomError, ValueError, retryable=False):
    """The members were given different batches for one step (a loader sharded by rank): not retried."""


class HealStateRefused(LoomError, ValueError, retryable=False):
    """The state a member sent does not fit this process's model and optimizer (a wrong or lying sender): nothing
    is loaded, and the job stops (not retried: the same sender would send it again)."""


class InjectedFault(LoomError, RuntimeError, retryable=True):
    """The ``raise`` fault of `loom.fault.inject`: an error inside a step (the step must be dropped on every
    member, and retried)."""


# -- starting a job (`loom.parallel`) ---------------------------------------------------------------------------
class StartRefused(LoomError, ValueError, retryable=False):
    """A job refused to start under the launcher's settings, the same on every rank. `loom.launch.worker` prints
    it as one line, without a traceback, and the launcher names it once."""


class BackendSelfTestError(LoomError, RuntimeError, retryable=False):
    """The backend's collectives did not give the values they must; training would be silently wrong."""


# -- the wire (`loom.net`, `loom.comm`, `loom.ps`) --------------------------------------------------------------
class StoreUnreachable(LoomError, RuntimeError, retryable=True):
    """The store did not answer in time, refused the job secret, or closed the connection."""


class StoreTimeout(LoomError, RuntimeError, retryable=True):
    """A wait for keys ran past its timeout (the store answered; the keys did not appear)."""


class HandshakeRefused(LoomError, RuntimeError, retryable=False):
    """The other side of a handshake did not prove the job secret, or refused ours."""


class FrameRefused(LoomError, ValueError, retryable=False):
    """A gossip frame header that does not belong on its connection (the message says why)."""


class FrameDropped(LoomError, retryable=False):
    """A parameter-server frame was rejected; ``reason`` is the counter it goes to."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# -- launching (`loom.launch`) ----------------------------------------------------------------------------------
class PeerLost(LoomError, RuntimeError, retryable=True):
    """This node cannot reach a node of its job (or the job's store), or a node did not join in time."""


class JobStops(LoomError, retryable=False):
    """The job cannot go on healing (past ``--max-heals``, below ``--min-workers``): stop every worker."""


class LauncherStopped(LoomError, retryable=False):
    """The launcher received ``signum`` (SIGINT, SIGTERM): it stops its workers and exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class GroupFailed(LoomError, retryable=False):
    """``loom run``'s worker group failed after its last restart (the launcher has said how), or a parameter
    server stopped it (`loom.launch.restarts`); its argument: the restarts done."""


class StoreNotForTorch(LoomError, RuntimeError, retryable=False):
    """A torch ``TCPStore`` (or a ``tcp://`` rendezvous that cannot be served) pointed at loom's store."""


# -- loom.horovod: Horovod's names ------------------------------------------------------------------------------
class HorovodInternalError(LoomError, RuntimeError, retryable=True):
    """A collective failed inside the engine (Horovod's name, a RuntimeError as there); retried as Horovod's is:
    ``hvd.elastic.run`` resumes from the last commit once loom has restarted the group."""


class HostsUpdatedInterrupt(LoomError, RuntimeError, retryable=True):  # noqa: N818 - Horovod's name
    """Horovod raises this when hosts join or leave an elastic job; under loom a changed job is a restart."""


# -- settings and the planner (`loom.settings`, `loom.plan`) --------------------------------------------------
class SettingError(LoomError, ValueError, retryable=False):
    """A ``LOOM_*`` variable whose value loom refuses (one line: the name, the value, the fix)."""


class ScriptCaptureError(LoomError, ValueError, retryable=False):
    """``loom plan`` could not capture the script: it built no model, or raised before handing it over."""


class OutsideCalibration(LoomError, ValueError, retryable=False):
    """A prediction would need a measurement the plan did not make (a batch size, a message size)."""


class PlanError(LoomError, ValueError, retryable=False):
    """``loom plan``: bad input or a failed measurement (one line, with the fix)."""


__all__ = [n for n, v in dict(globals()).items() if isinstance(v, type) and issubclass(v, LoomError)]
__all__ += ["check_choice", "check_int", "failure_text", "is_retryable"]


def check_int(name: str, value: object, least: int = 1, *, optional: bool = False, hint: str = "") -> None:
    """Refuse anything but an int >= ``least`` (bools too; None passes where ``optional``): a ValueError
    naming the option ``name``, the value and, where given, the ``hint`` (the fix)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        either = "None or " if optional else ""
        hint = f". HINT: {hint}" if hint else ""
        raise ValueError(f"{name} must be {either}an int >= {least}, got {value!r}{hint}")


def check_choice(name: str, value: object, choices: tuple[object, ...], hint: str = "") -> None:
    """Refuse a ``value`` not among ``choices`` (a bool is not the int it equals): a ValueError naming the
    option ``name``, the value, the allowed values and, where given, the ``hint`` (the fix)."""
    if not any(c == value and isinstance(c, bool) == isinstance(value, bool) for c in choices):
        hint = f". HINT: {hint}" if hint else ""
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}{hint}")
