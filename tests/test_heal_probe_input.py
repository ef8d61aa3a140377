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


# -- the state a replacement receives: checked before anything is allocated from it -----------------------------
def _adam_after_one_step():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.unit
def test_the_real_header_passes_and_forged_ones_are_refused_naming_what_is_wrong():
    import copy

    from loom.train.heal_state import HealStateRefused, _header, check_header

    model, optimizer = _adam_after_one_step()
    header, _ = _header(optimizer, 7)
    fresh = torch_fresh_optimizer(model)
    check_header(header, model, fresh, 0)  # a replacement's optimizer has no state yet: accepted

    def forged(change):
        bad = copy.deepcopy(header)
        change(bad)
        return bad

    deep: dict = {}
    for _ in range(100_000):  # past the interpreter's recursion limit
        deep = {"a": deep}

    def alias(h):  # parameter 1's state names parameter 0's exp_avg too; every tensor still used
        items = h["skeleton"]["state"]["items"]
        items[1][1]["extra"] = items[0][1]["exp_avg"]

    cases = {
        "claims the step -1": lambda h: h.update(step=-1),
        "a shape or dtype not one": lambda h: h["tensors"].append(["x", "torch.float32", [2**70, 0]]),
        "names one tensor for two states": alias,
        "skeleton that is not an optimizer's state (maximum recursion": lambda h: h.update(skeleton=deep),
        "claims the step 'x'": lambda h: h.update(step="x"),
        "parameter index outside 0..3": lambda h: h["skeleton"]["state"]["items"].append([99, {}]),
        "shape or dtype not one a tensor has": lambda h: h["tensors"].append(["x", "torch.float32", [-1]]),
        "a key twice": lambda h: h["tensors"].append(h["tensors"][0]),
        "more than": lambda h: h["tensors"].append(["x", "torch.float32", [10**6, 10**6]]),
        "not an optimizer's state": lambda h: h["tensors"].append(["x", "torch.float32", [1]]),
        "RNG state of 3 bytes": lambda h: h.update(rng_numel=3),
        "2 parameter groups holding": lambda h: h["skeleton"]["param_groups"].append({"params": [9]}),
        "has no list of tensors": lambda h: h.update(tensors="all"),
    }
    for words, change in cases.items():
        with pytest.raises(
            HealStateRefused,
            match=f"sent by member index 0 .*{__import__('re').escape(words)}.*nothing is loaded",
        ):
            check_header(forged(change), model, fresh, 0)
    assert not HealStateRefused.retryable  # the job stops instead of re-forming into the same sender


def torch_fresh_optimizer(model):
    import torch

    return torch.optim.Adam(model.parameters(), lr=1e-2)


@pytest.mark.unit
def test_a_header_size_past_the_bound_is_refused_before_any_allocation_and_a_true_transfer_loads():
    import torch
    from threads import run_ranks

    from loom.train.heal_state import MAX_HEADER_BYTES, broadcast, share_training_state

    def lying_sender(rank, group):
        model, optimizer = _adam_after_one_step()
        if rank == 0:  # announces a 1 TiB header and stops
            broadcast(torch.tensor([1 << 40], dtype=torch.int64), 0, group)
            return None
        try:
            share_training_state(model, optimizer, 0, 0, rank, group, load=True, replacement=True)
        except ValueError as error:
            return str(error)
        return "loaded"

    refused = run_ranks(2, lying_sender)[1]
    assert f"announced a header of {1 << 40} bytes (at most {MAX_HEADER_BYTES})" in refused

    def honest(rank, group):
        model, optimizer = _adam_after_one_step()
        if rank == 1:  # a replacement: fresh parameters, no optimizer state
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            optimizer = torch_fresh_optimizer(model)
        step = share_training_state(model, optimizer, 9 if rank == 0 else -1, 0, rank, group, load=rank == 1,
                                    replacement=True)  # fmt: skip
        return step, [p.detach().clone() for p in model.parameters()], optimizer.state_dict()

    (step0, params0, states0), (step1, params1, states1) = run_ranks(2, honest)
    assert step1 == step0 == 9 and len(states1["state"]) == len(states0["state"]) == 4
    assert all(torch.equal(a, b) for a, b in zip(params0, params1, strict=True))
    assert states1["param_groups"] == states0["param_groups"]
    for sent, got in zip(states0["state"].values(), states1["state"].values(), strict=True):
        assert sent.keys() == got.keys() and all(torch.equal(sent[k], got[k]) for k in sent)
