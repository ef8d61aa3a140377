"""loom.errors: one place for every error class loom raises on purpose, all under LoomError (issue 21, item 7)."""

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import loom
from loom import errors
from loom.checkpoint import store
from loom.fault import desync, watchdog
from loom.parallel import consistency

pytestmark = pytest.mark.unit


def test_every_error_class_is_a_loom_error_and_keeps_its_builtin_base():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    functions = {"check_choice", "check_int", "is_retryable", "failure_text"}
    assert sorted(c.__name__ for c in classes) == sorted(n for n in errors.__all__ if n not in functions)
    assert all(issubclass(c, errors.LoomError) for c in classes)
    assert issubclass(errors.ModelMismatchError, ValueError) and issubclass(errors.HangError, RuntimeError)
    assert issubclass(errors.NonFiniteStepError, FloatingPointError)


def test_the_modules_that_raise_them_name_the_same_classes():
    assert loom.errors is errors
    assert desync.NonFiniteStepError is errors.NonFiniteStepError and watchdog.HangError is errors.HangError
    assert store.CorruptCheckpointError is errors.CorruptCheckpointError
    assert consistency.ModelMismatchError is errors.ModelMismatchError


def test_a_nonfinite_stop_is_caught_as_a_loom_error():
    guard = desync.NonFiniteGuard("stop", rank=0)
    try:
        guard.judge(1, [1.0], [0])
    except errors.LoomError as err:
        assert "step 1 is non-finite" in str(err)
    else:
        raise AssertionError("no error raised")


CONTROL_FLOW = {"loom.plan.capture._Captured"}
"""Exception classes that are no error of loom's: private signals raised and caught inside one module."""


def _exception_classes_of_loom() -> list[type]:
    """Every exception class a module of src/loom defines (each module imported: ``loom.ray`` and
    ``loom.spark`` import no Ray or Spark at load)."""
    found = []
    for info in pkgutil.walk_packages(loom.__path__, "loom."):
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == info.name:
                found.append(value)
    return found


@pytest.mark.timeout(120)
def test_every_exception_class_of_loom_is_a_loom_error_that_declares_retryable():
    classes = _exception_classes_of_loom()
    assert errors.HealConflict in classes and errors.LoomError in classes  # the walk reaches the classes
    strays = [
        f"{c.__module__}.{c.__qualname__}"
        for c in classes
        if not issubclass(c, (errors.LoomError, Warning))
        and f"{c.__module__}.{c.__qualname__}" not in CONTROL_FLOW
    ]
    assert strays == [], f"exception classes outside loom.errors' hierarchy: {strays}"
    undeclared = [
        c.__name__ for c in classes if issubclass(c, errors.LoomError) and "retryable" not in vars(c)
    ]
    assert undeclared == [], f"these LoomErrors do not state retryable: {undeclared}"
    assert [c.__module__ for c in classes if issubclass(c, errors.LoomError)] == ["loom.errors"] * len(
        [c for c in classes if issubclass(c, errors.LoomError)]
    )


def test_retryable_is_read_from_the_class_and_foreign_errors_are_retried():
    assert errors.is_retryable(errors.StepDropped("dropped")) and errors.is_retryable(
        errors.InjectedFault("x")
    )
    assert not errors.is_retryable(errors.HealConflict("claims apart"))
    assert not errors.is_retryable(errors.HealStateRefused("a lying sender"))
    assert not errors.is_retryable(errors.DifferentBatches("sharded by rank"))
    assert errors.is_retryable(RuntimeError("gloo: connection reset by peer"))  # what a lost peer raises
    assert errors.LeftOutOfQuorum.exit_status == 75 and not errors.LeftOutOfQuorum.retryable


def test_a_users_subclass_may_omit_retryable_and_inherits_its_bases():
    class Mine(errors.StepDropped):  # a user's own refinement of a loom error: no class keyword needed
        pass

    class Theirs(errors.CheckpointError):
        pass

    assert Mine.retryable and not Theirs.retryable


def test_no_code_reads_retry_ability_by_duck_typing():
    src = Path(loom.__file__).parent
    duck = re.compile(r"(getattr|hasattr)\(\s*\w+\s*,\s*[\"'](loom_\w+|retryable|\w*retr\w*)[\"']")
    found = [
        f"{p.relative_to(src)}:{m.group(0)}" for p in src.rglob("*.py") for m in duck.finditer(p.read_text())
    ]
    assert found == []
    assert not [p for p in src.rglob("*.py") if "loom_not_retried" in p.read_text()]


def test_check_int_refuses_a_non_int_a_bool_or_too_small_naming_the_option_the_value_and_the_fix():
    errors.check_int("n", 3)
    errors.check_int("n", 0, 0)
    errors.check_int("n", None, optional=True)
    for bad in (True, 2.5, "3", None, 0):
        with pytest.raises(ValueError, match=rf"^n must be an int >= 1, got {bad!r}$"):
            errors.check_int("n", bad)
    with pytest.raises(
        ValueError, match=r"^keep must be None or an int >= 1, got -1\. HINT: None keeps all$"
    ):
        errors.check_int("keep", -1, optional=True, hint="None keeps all")


def test_check_choice_refuses_a_value_not_among_the_choices_naming_the_option_the_value_the_choices_and_the_fix():
    errors.check_choice("stage", 2, (1, 2, 3))
    errors.check_choice("mixed_precision", None, (None, "bf16"))
    errors.check_choice("flag", True, (True, False))
    for bad in (True, 4, "1", None):  # a bool is not the int it equals
        with pytest.raises(ValueError, match=rf"^stage must be one of 1, 2, 3, got {bad!r}$"):
            errors.check_choice("stage", bad, (1, 2, 3))
    with pytest.raises(ValueError, match=r"^mode must be one of 'sync', 'ssp', got 'x'\. HINT: use 'sync'$"):
        errors.check_choice("mode", "x", ("sync", "ssp"), hint="use 'sync'")
