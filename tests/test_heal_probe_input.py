"""Heal's options checked before anything starts (issue 23's probe, bad input): ``heal`` with one worker,
``--max-heals``/``--min-workers`` without ``heal``, and ``LOOM_FAULTS`` malformed or naming a rank the job does not
have. Before, the first ended in a worker's misleading error ("heal needs loom.init() under loom run") after the
job started, the second was ignored silently, the third was found at a worker's first step (or never)."""

from __future__ import annotations

import pytest

from loom.launch.spec import LaunchSpec


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


@pytest.mark.unit
def test_heal_with_one_worker_is_refused_naming_the_ways_that_work(script):
    with pytest.raises(ValueError, match=r"heal with -n 1: .* none is left .*-n 2.*--max-restarts"):
        LaunchSpec(target=script, nproc=1, on_worker_failure="heal")
    LaunchSpec(target=script, nproc=2, on_worker_failure="heal")  # two workers heal


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_max_heals_and_min_workers_without_heal_are_refused(script, policy):
    with pytest.raises(ValueError, match=rf"--max-heals 5: heal's options.*--on-worker-failure {policy}"):
        LaunchSpec(target=script, nproc=3, on_worker_failure=policy, max_heals=5)
    with pytest.raises(ValueError, match=r"--max-heals 0 and --min-workers 2: heal's options"):
        LaunchSpec(target=script, nproc=3, on_worker_failure=policy, max_heals=0, min_workers=2)
    LaunchSpec(target=script, nproc=3, on_worker_failure=policy)  # the defaults pass


@pytest.mark.unit
@pytest.mark.parametrize("heal", [10**12, 0])
def test_heal_budgets_at_their_edges_are_accepted(script, heal):
    spec = LaunchSpec(target=script, nproc=3, on_worker_failure="heal", max_heals=heal, min_workers=3)
    assert spec.max_heals == heal


@pytest.mark.unit
@pytest.mark.parametrize(
    "value", ["kill@0", "kill@x:1:before", "kill@0:1:nowhere", "boom@0:1:before", "kill@-1:1:before"]
)
def test_a_malformed_loom_faults_is_refused_at_launch_naming_the_value_and_the_form(
    script, monkeypatch, value
):
    monkeypatch.setenv("LOOM_FAULTS", value)
    with pytest.raises(
        ValueError, match=r"is not KIND@RANK:STEP:PHASE\[#GENERATION\].*e\.g\. 'kill@1:3:during'"
    ) as err:
        LaunchSpec(target=script, nproc=3, on_worker_failure="heal")
    assert repr(value) in str(err.value)


@pytest.mark.unit
def test_loom_faults_naming_a_rank_outside_the_job_is_refused(script, monkeypatch):
    monkeypatch.setenv("LOOM_FAULTS", "kill@1:3:during,kill@5:1:before")
    with pytest.raises(ValueError, match=r"names rank\(s\) \[5\], but the job's ranks are 0\.\.2"):
        LaunchSpec(target=script, nproc=3, on_worker_failure="heal")
    monkeypatch.setenv("LOOM_FAULTS", "kill@2:3:during, ")
    LaunchSpec(target=script, nproc=3, on_worker_failure="heal")
