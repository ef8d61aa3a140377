"""Pipeline equals one process on the same global batches, for p = 2 and 4, m = 1, 2, 4, 8, both schedules."""

import json

import pytest
import torch
from torch import nn
from workers.common import make_dataset, make_optimizer
from workers.pp_common import deep_reference, make_deep_mlp

import loom
from loom.parallel.pipeline.pipeline import Pipeline
from loom.topology import Topology

SINGLE = Topology(0, 1, 0, 1, "none")
STEPS = 3


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stages", [2, 4])
def test_matches_one_process(workers, stages):
    outputs = workers("pp_exact.py", stages, str(STEPS), timeout=110)
    refs = {gb: deep_reference("adam", gb, STEPS) for gb in (10, 3)}
    data = make_dataset()
    for rank, out in enumerate(outputs):
        runs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(runs) == 16, f"rank {rank} printed {len(runs)} runs"
        for run in runs:
            label = f"rank {rank} p={stages} {run['schedule']} m={run['m']} batch={run['global_batch']}"
            ref_losses, ref_params = refs[run["global_batch"]]
            assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True)) <= 1e-5, label
            # 1F1B keeps at most p - stage micro-batches alive; GPipe keeps all m (fewer if the batch is smaller).
            live = min(run["m"], run["global_batch"])
            expected = live if run["schedule"] == "gpipe" else min(live, stages - rank)
            assert run["peak_live"] == expected, label
            if rank == 0:
                model = make_deep_mlp()
                model.load_state_dict(
                    {k: torch.tensor(v).view_as(ref_params[k]) for k, v in run["params"].items()}
                )
                for name, ref in ref_params.items():
                    got = model.state_dict()[name]
                    assert (got - ref).abs().max().item() <= 1e-5, f"{label}: {name}"
                x, y = data.tensors
                with torch.no_grad():
                    expected_eval = nn.functional.mse_loss(model(x), y).item()
                assert run["eval"] == pytest.approx(expected_eval, abs=1e-5), label


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_single_stage_matches_reference_with_uneven_microbatches(schedule):
    model = make_deep_mlp()
    job = Pipeline(stages=1, microbatches=4, schedule=schedule, topology=SINGLE).setup(
        model, make_optimizer("adam", model), nn.functional.mse_loss
    )
    loader = loom.data.loader(make_dataset(), 10, seed=1, topology=job.data_topology)
    losses = [job.train_step(b) for b in loader]  # batches of 10, 10, 10, 7: micro-batches of 2-3 and 1-2
    ref_losses, ref_params = deep_reference("adam", 10, len(losses))
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    full = job.full_state_dict()
    for name, ref in ref_params.items():
        torch.testing.assert_close(full[name], ref, atol=1e-6, rtol=0)
    state = job.state_dict()
    assert state["shard"]["stage"] == 0 and state["shard"]["layers"] == [""]  # one stage: the whole model
    job.load_state_dict(state)
