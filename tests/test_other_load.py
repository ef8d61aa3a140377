"""The demo's speed-up says when a half ran beside other load (issue 36): `loom.demo.other_load`."""

from __future__ import annotations

import pytest

from loom.demo import other_load
from loom.demo.other_load import BUSY_SHARE, OtherLoad, caveat


@pytest.mark.unit
def test_the_share_is_the_machines_busy_time_less_the_demos_own_children(monkeypatch):
    clock, busy, ours = iter([100.0, 110.0]), iter([50.0, 62.0]), iter([3.0, 9.0])
    monkeypatch.setattr(other_load.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(other_load, "_busy_cpu_s", lambda: next(busy))
    monkeypatch.setattr(other_load, "_children_cpu_s", lambda: next(ours))
    monkeypatch.setattr(other_load.os, "cpu_count", lambda: 2)
    with OtherLoad() as load:
        pass
    # 12 CPU-seconds busy over 10 s on 2 CPUs, 6 of them the demo's: others used 6 / 20 of the machine
    assert load.share == pytest.approx(0.3)


@pytest.mark.unit
def test_the_machine_counters_read_on_linux():
    assert other_load._busy_cpu_s() is not None and other_load._busy_cpu_s() >= 0
    with OtherLoad() as load:
        sum(i * i for i in range(10_000))
    assert load.share is not None and load.share >= 0


@pytest.mark.unit
def test_a_caveat_only_when_either_half_ran_beside_other_load():
    assert caveat(0.0, BUSY_SHARE / 2) is None
    assert caveat(None, 0.9) is None  # unknown (not Linux): no claim either way
    line = caveat(0.05, 0.6)
    assert line is not None and "60% during the one-process half" in line and "quiet machine" in line
