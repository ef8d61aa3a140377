"""ShardedDataParallel at 4 processes, and checkpoints resharded N -> M for every N, M in {1, 2, 3, 4}.

Few launches with many checks each (the machine is slow and every launch pays for interpreters and process
groups): the 4-process exactness is one launch (tests/workers/sharded_exact.py); the matrix writes one checkpoint
per world size N (a module fixture, one launch per N) and resumes all of them at each M in one launch per M
(tests/workers/sharded_reshard.py).
"""

import shutil

import pytest
import torch
from test_sharded import _assemble, _assert_params, _runs
from torch import nn
from workers.common import make_dataset, make_mlp, reference_run

TOL = 1e-5
WORLDS = (1, 2, 3, 4)
WRITTEN, RESUMED = 4, 7  # steps: 7-sample batches over 37 samples, so the resumed part crosses an epoch


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_stages_at_four_processes_match_one_process(workers):
    """4 processes, global batch 9 (shares 3, 2, 2, 2), 5 steps: the fifth batch is the epoch's last sample, so
    three of the four shares are empty; SGD with momentum, Adam, and Adam with accumulate=3 (2 samples in 3
    micro-batches: an empty micro-batch on most ranks). Every stage (stage 1 with its all-reduce and with its
    reduce-scatter) equals one process within 1e-5: losses, parameters and the evaluated loss."""
    steps, global_batch, world_size = 5, 9, 4
    outputs = workers("sharded_exact.py", world_size, str(global_batch), str(steps), "1,1rs,2,3", timeout=480)
    by_rank = [_runs(out) for out in outputs]
    assert all(len(runs) == 12 for runs in by_rank), [len(r) for r in by_rank]
    refs = {opt: reference_run(opt, global_batch, steps) for opt in ("sgd", "adam")}
    x, y = make_dataset().tensors
    for i, run in enumerate(by_rank[0]):
        label = f"stage {run['stage']} {run['optimizer']} accumulate={run['accumulate']} N={world_size}"
        ref_losses, ref_params = refs[run["optimizer"]]
        for rank_runs in by_rank:
            assert rank_runs[i]["losses"] == run["losses"], f"{label}: ranks report different losses"
        assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True)) <= TOL, label
        _assert_params(_assemble([rank_runs[i]["params"] for rank_runs in by_rank]), ref_params, label)
        model = make_mlp()
        model.load_state_dict(ref_params)
        with torch.no_grad():
            assert abs(run["eval"] - nn.functional.mse_loss(model(x), y).item()) <= TOL, label


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """``{N: checkpoint root}``: WRITTEN steps of every stage at N processes, each checked against one process."""
    from conftest import run_workers

    root = tmp_path_factory.mktemp("reshard")
    expected = reference_run("sgd", 7, WRITTEN)[1]
    roots = {}
    for n in WORLDS:
        roots[n] = root / f"written_by_{n}"
        outputs = run_workers("sharded_reshard.py", n, "write", str(roots[n]), str(WRITTEN), timeout=200)
        by_rank = [_runs(out) for out in outputs]
        for i, stage in enumerate((1, 2, 3)):
            assert all(r[i]["stage"] == stage and r[i]["step"] == WRITTEN for r in by_rank)
            _assert_params(_assemble([r[i]["params"] for r in by_rank]), expected, f"stage {stage} at N={n}")
    return roots


@pytest.mark.system
@pytest.mark.timeout(600)
@pytest.mark.parametrize("m", WORLDS)
def test_checkpoint_written_at_n_resumes_at_m(workers, written, tmp_path, m):
    """Every stage's checkpoint of WRITTEN steps at N processes (N = 1..4) resumed at M processes to RESUMED
    steps (SGD + momentum, the data position resharded too) equals RESUMED steps of one process within 1e-5:
    all 16 pairs (N == M is the plain resume), every stage."""
    expected = reference_run("sgd", 7, RESUMED)[1]
    copies = []
    for n in WORLDS:  # a copy each: the resumed fit writes its own checkpoint into the directory
        copies.append(tmp_path / f"from_{n}")
        shutil.copytree(written[n], copies[-1])
    outputs = workers("sharded_reshard.py", m, "resume", str(RESUMED), *map(str, copies), timeout=560)
    by_rank = [_runs(out) for out in outputs]
    assert all(len(r) == 3 * len(WORLDS) for r in by_rank), [len(r) for r in by_rank]
    for i, run in enumerate(by_rank[0]):
        n = WORLDS[i // 3]
        label = f"stage {run['stage']}: {n} -> {m} processes"
        assert run["root"] == str(copies[i // 3]) and run["resumed_from"] == WRITTEN, (
            label,
            run["resumed_from"],
        )
        assert all(r[i]["step"] == RESUMED for r in by_rank), label
        _assert_params(_assemble([r[i]["params"] for r in by_rank]), expected, label)
