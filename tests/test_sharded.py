"""ShardedDataParallel (ZeRO 1, 2, 3) equals one process; its guards, memory, checkpoints and export.

The multi-process checks are few launches with several checks each (tests/workers/sharded_*.py): the machine
is slow, and every launch pays for interpreters and process groups.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn
from workers.common import make_mlp, reference_run

TOL = 1e-5


def _runs(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _assemble(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """The whole parameters from every rank's pieces (each with its bounds), checking full coverage."""
    shapes = {k: v.shape for k, v in make_mlp().state_dict().items()}
    full = {k: torch.full((s.numel(),), float("nan")) for k, s in shapes.items()}
    for params in ranks:
        for name, piece in params.items():
            full[name][piece["lo"] : piece["hi"]] = torch.tensor(piece["value"])
    for name, t in full.items():
        assert not t.isnan().any(), f"{name}: not every element is held by some rank"
    return {k: t.view(shapes[k]) for k, t in full.items()}


def _assert_params(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], label: str) -> None:
    for name, value in ref.items():
        diff = (got[name] - value).abs().max().item()
        assert diff <= TOL, f"{label}: {name} differs by {diff}"


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("world_size", "global_batch"), [(2, 5), (3, 7)])
def test_stages_match_one_process(workers, world_size, global_batch):
    """Uneven shares (5 over 2, 7 over 3), accumulate=3 with fewer samples than micro-batches on some ranks, an
    empty share (the last batch of 2 samples over 3 ranks), SGD with momentum and Adam: every stage equals one
    process on the same global batches, losses and parameters within 1e-5 (stage 1 both with its all-reduce
    and with its reduce-scatter, "1rs")."""
    steps = 8
    outputs = workers("sharded_exact.py", world_size, str(global_batch), str(steps), "1,1rs,2,3", timeout=380)
    by_rank = [_runs(out) for out in outputs]
    assert all(len(runs) == 12 for runs in by_rank), [len(r) for r in by_rank]
    refs = {opt: reference_run(opt, global_batch, steps) for opt in ("sgd", "adam")}
    x, y = __import__("workers.common", fromlist=["make_dataset"]).make_dataset().tensors
    for i, run in enumerate(by_rank[0]):
        label = f"stage {run['stage']} {run['optimizer']} accumulate={run['accumulate']} N={world_size}"
        ref_losses, ref_params = refs[run["optimizer"]]
        for rank_runs in by_rank:
            assert rank_runs[i]["losses"] == run["losses"], f"{label}: ranks report different losses"
        assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses, strict=True)) <= TOL, label
        got = _assemble([rank_runs[i]["params"] for rank_runs in by_rank])
        _assert_params(got, ref_params, label)
        model = make_mlp()
        model.load_state_dict(ref_params)
        with torch.no_grad():
            assert abs(run["eval"] - nn.functional.mse_loss(model(x), y).item()) <= TOL, label


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_nonfinite_step_skipped_and_memory_within_zero_share(workers):
    """A NaN on one rank's share: the step is skipped on every rank at every stage, nothing changes. Memory:
        the persistent state counted over every live tensor is at most 1.10 x the stage's ZeRO share of the
        one-process Adam state (16 bytes per parameter), at 2 processes; the engine's sample in step 2's record equals
    it."""
    from loom.parallel.data.sharded_memory import zero_share

    outputs = workers("sharded_checks.py", 2, "guards", timeout=280)
    for rank, out in enumerate(outputs):
        runs = _runs(out)
        nan = [r for r in runs if r["check"] == "nan"]
        assert [r["stage"] for r in nan] == [1, 2, 3]
        for r in nan:
            assert r["skipped"] == 1 and r["unchanged"], f"rank {rank}: {r}"
        memory = [r for r in runs if r["check"] == "memory"]
        assert [r["stage"] for r in memory] == [1, 2, 3]
        for r in memory:
            bound = 1.10 * zero_share(r["stage"], 2) * 16 * r["params"]
            state = r["memory"]["state"]
            assert state <= bound, f"rank {rank} stage {r['stage']}: {state} bytes > {bound:.0f}"
            assert state == sum(r["memory"][c] for c in ("parameters", "gradients", "optimizer"))
            assert r["memory"]["optimizer"] <= 1.10 * 8 * r["params"] / 2  # Adam's moments: sharded
            sampled = r["record"]  # the step record's cheap count equals the heap walk's, FSDP2's shards too
            assert {c: sampled["memory"][c] for c in ("parameters", "gradients", "optimizer", "state")} == {
                c: r["memory"][c] for c in ("parameters", "gradients", "optimizer", "state")
            }, f"rank {rank} stage {r['stage']}"
            assert sampled["peak"] >= sampled["rss"] > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_checkpoint_reshards_and_exports(workers, tmp_path):
    """loom.fit with SGD + momentum: 10 steps at 2 processes, resumed to 20 at 3, then to 25 at 1, each equal to
    one process (1e-5) at every stage; `loom export` of the 3-process checkpoints loads into the plain model."""
    root = str(tmp_path / "ckpt")
    expected = {steps: reference_run("sgd", 7, steps)[1] for steps in (10, 20, 25)}
    for world, steps in ((2, 10), (3, 20)):
        outputs = workers("sharded_checks.py", world, "fit", root, str(steps), timeout=280)
        by_rank = [_runs(out) for out in outputs]
        for i, stage in enumerate((1, 2, 3)):
            assert all(r[i]["stage"] == stage and r[i]["step"] == steps for r in by_rank)
            got = _assemble([r[i]["params"] for r in by_rank])
            _assert_params(got, expected[steps], f"stage {stage} at {world} processes, step {steps}")
    for stage in (1, 2, 3):
        out = tmp_path / f"stage{stage}.safetensors"
        done = subprocess.run(
            [sys.executable, "-m", "loom.cli", "export", f"{root}/stage{stage}", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        model = make_mlp()
        model.load_state_dict(safetensors.torch.load_file(out), strict=True)
        _assert_params(dict(model.state_dict()), expected[20], f"export of stage {stage}")
    outputs = workers("sharded_checks.py", 1, "fit", root, "25", timeout=200)
    for i, run in enumerate(_runs(outputs[0])):
        _assert_params(_assemble([run["params"]]), expected[25], f"stage {i + 1} resumed at 1 process")


@pytest.mark.system
@pytest.mark.timeout(400)
def test_sigkilled_worker_restarts_and_resumes(tmp_path):
    """Under ``loom run --max-restarts 2`` a rank SIGKILLs itself before step 8, once in stage 1 and once in
    stage 3: each group restarts, resumes from the checkpoint of step 5, and ends equal to 12 steps of one
    process (SGD + momentum, 1e-5)."""
    from test_launcher import run_loom, wait_until_gone

    script = Path(__file__).parent / "workers" / "sharded_checks.py"
    args = [
        "run",
        "-n",
        2,
        "--max-restarts",
        2,
        "--run-dir",
        tmp_path / "run",
        script,
        "elastic",
        tmp_path / "ckpt",
    ]
    result = run_loom([*args, 12, 8], tmp_path, timeout=380)
    assert result.returncode == 0, result.stderr[-3000:]
    assert wait_until_gone(str(script)) == []
    records = [json.loads(line[line.index("{") :]) for line in result.stdout.splitlines() if "{" in line]
    expected = reference_run("sgd", 7, 12)[1]
    for stage, resumed in ((1, 12), (3, 5)):  # stage 1 finished in attempt 1; stage 3 resumed in attempt 2
        final = [r for r in records if r["stage"] == stage and r["attempt"] == 2]
        assert sorted(r["rank"] for r in final) == [0, 1] and all(r["step"] == 12 for r in final), final
        assert all(r["resumed_from"] == resumed for r in final), [r["resumed_from"] for r in final]
        _assert_params(_assemble([r["params"] for r in final]), expected, f"stage {stage} after restarts")
    restarted = [r for r in records if r["stage"] == 1 and r["attempt"] == 1]
    assert all(r["resumed_from"] == 5 for r in restarted), restarted


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_mixed_precision_stays_close_to_float32_and_keeps_float32_master_weights(workers):
    """bf16/fp16 compute (FSDP2's cast around each unit), float32 reduction and master weights: close to one
    float32 process, and not equal to it (the cast really happened)."""
    outputs = workers("sharded_mixed.py", 2, timeout=230)
    for rank, out in enumerate(outputs):
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(records) == 4, f"rank {rank}: {out[-2000:]}"
        for r in records:
            assert r["master"] == ["torch.float32"], r
            assert r["params"] <= 2e-2 and r["loss"] <= 2e-2, r
            assert r["params"] > 0 or r["loss"] > 0, f"mixed precision changed nothing: {r}"
