"""The kill soak's reading of the workers' lines (`loom_bench.kill_soak.Live`); the soak itself is a benchmark."""

import io
import time

import pytest

from loom_bench.kill_soak import Live


@pytest.mark.unit
def test_live_keeps_each_ranks_newest_process_and_step():
    live = Live()
    before = time.monotonic()
    live.read(
        io.StringIO(
            "[rank0]: soak rank 0 pid 11 step 10\n"
            "[rank1]: soak rank 1 pid 12 step 10\n"
            "loom run: rank 1 died\n"
            "[rank1]: soak rank 1 pid 13 step 20\n"
        )
    )
    assert live.pid == {0: 11, 1: 13} and live.step == {0: 10, 1: 20}
    assert live.all_trained_since(before, 2)
    assert not live.all_trained_since(before, 3)  # rank 2 never said a word
    assert not live.all_trained_since(time.monotonic(), 2)
    assert len(live.lines) == 4


@pytest.mark.unit
def test_the_soak_reads_each_processes_resources_and_flags_growth():
    import os

    from loom_bench.kill_soak import Usage, Watched, flat

    me = Usage.of(os.getpid(), heals=0)
    assert me is not None and me.fds > 0 and me.threads >= 1 and me.rss_mib > 1
    assert Usage.of(2**22 + 7, heals=0) is None  # no such process: nothing, no error
    watched = Watched()
    watched.sample(os.getpid(), [os.getpid()], heals=0)
    watched.sample(os.getpid(), [os.getpid()], heals=5)
    summary = watched.summary()
    assert summary["launcher"]["first"]["heals"] == 0 and summary["launcher"]["last"]["heals"] == 5
    assert flat(summary)
    summary["launcher"]["last"]["fds"] += 2  # two descriptors more after the heals: a leak
    assert not flat(summary)
