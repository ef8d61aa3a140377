"""loom.errors: one place for every error class loom raises on purpose, all under LoomError (issue 21, item 7)."""

import inspect

import pytest

import loom
from loom import errors
from loom.checkpoint import store
from loom.fault import desync, watchdog
from loom.parallel import consistency

pytestmark = pytest.mark.unit


def test_every_error_class_is_a_loom_error_and_keeps_its_builtin_base():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert sorted(c.__name__ for c in classes) == sorted(errors.__all__)
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
