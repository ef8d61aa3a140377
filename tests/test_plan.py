"""`loom.plan`: the cost model on synthetic profiles (the GPipe bubble, a link-bound all-reduce, ZeRO's shares),
the script capture, the profile, and bad input. One process, no sockets (the system test is test_plan_system.py).
"""

from __future__ import annotations

import argparse
import math
import shlex
import types
from pathlib import Path

import pytest

from loom.parallel.data.sharded_memory import zero_share
from loom.plan.capture import ScriptCaptureError, capture_script
from loom.plan.codecs import measure_codec
from loom.plan.configs import Configuration, candidates
from loom.plan.cost import predict
from loom.plan.planner import PlanError, check_fits
from loom.plan.profile import (
    BatchProfile,
    LayerProfile,
    ModelProfile,
    OutsideCalibration,
    profile_model,
)
from loom.plan.recommend import rank, to_json
from loom.plan.transport import Transport, envelope, link_bound_seconds, parse_rate

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

TINY = str(Path(__file__).parent / "workers" / "plan_tiny.py")


def _profile(layers: int = 4, fwd: float = 1.0, bwd: float = 2.0, params: int = 1000, sizes=(8, 16, 32, 64)):
    """Equal layers of ``params`` float32 parameters each, times independent of the batch size."""

    def at(size: int) -> BatchProfile:
        row = [
            LayerProfile(f"{i}", 4 * params, params, fwd, bwd, 100 * size, 10 * size) for i in range(layers)
        ]
        return BatchProfile(size, fwd * layers, bwd * layers, tuple(row))

    total = 4 * params * layers
    return ModelProfile(total, total, 2 * total, params * layers, 0.0, True, "", 1, {s: at(s) for s in sizes})


def _transport(seconds: float = 0.0, hosts: int = 1, rate: float | None = None, world: int = 2) -> Transport:
    sizes = (8, 1 << 30)
    ops = ["allreduce:native", "allreduce:ring", "all_gather", "reduce_scatter", "p2p"]
    return Transport(world, sizes, {op: (seconds, seconds) for op in ops}, 0.0, hosts, rate)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (4, 4), (4, 8)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_pipeline_bubble_of_equal_stages_is_gpipes(p, m, schedule):
    profile = _profile(layers=8, fwd=1.0, bwd=2.0, sizes=(64 // m, 64))
    config = Configuration(
        "Pipeline", p, (("stages", p), ("microbatches", m), ("schedule", schedule)), dp=1, pp=p
    )
    got = predict(config, profile, _transport(), 64)
    assert not got.refused
    assert got.bubble == pytest.approx((p - 1) / (m + p - 1))
    per_stage = (1.0 + 2.0) * 8 / p  # each micro-batch's forward and backward on one stage
    assert got.step_time_s == pytest.approx((m + p - 1) * per_stage)


def test_1f1b_holds_fewer_microbatches_of_activations_than_gpipe():
    profile = _profile(layers=4, sizes=(8, 64))
    kw = dict(dp=1, pp=2)
    gpipe = predict(Configuration("Pipeline", 2, (("stages", 2), ("microbatches", 8), ("schedule", "gpipe")), **kw),
                    profile, _transport(), 64)  # fmt: skip
    one_f = predict(Configuration("Pipeline", 2, (("stages", 2), ("microbatches", 8), ("schedule", "1f1b")), **kw),
                    profile, _transport(), 64)  # fmt: skip
    stage_activations = 2 * 100 * 8  # two layers, 100 bytes per sample each, micro-batches of 8
    assert gpipe.memory["activations"] == 8 * stage_activations
    assert one_f.memory["activations"] == 2 * stage_activations


@pytest.mark.parametrize(("hosts", "slots"), [(1, 2), (2, 1)])
def test_a_hybrids_data_axis_on_one_host_holds_one_gradient_slot_per_replica(hosts, slots):
    """`GradientAveraging.for_stage` takes `SharedGradients` over the data axis on one CPU host: every ``.grad``
    of the stage is a view of a segment with one slot per replica, which ``job.memory()`` counts whole."""
    profile = _profile(layers=4, sizes=(8, 16, 32, 64))
    opts = (("dp", 2), ("pp", 2), ("microbatches", 2), ("schedule", "1f1b"))
    got = predict(Configuration("Hybrid", 4, opts, dp=2, pp=2, hosts=hosts), profile, _transport(world=4), 64)
    stage = profile.param_bytes // 2  # four equal layers cut in two
    state = [got.memory[k] for k in ("parameters", "gradients", "optimizer")]
    assert state == [stage, slots * stage, 2 * stage]


@pytest.mark.parametrize("world", [2, 4])
def test_a_link_bound_all_reduce_takes_2_n_minus_1_over_n_bytes_over_the_rate(world):
    rate = parse_rate("100mbit")
    assert rate == 100e6 / 8
    transport = _transport(seconds=1e-6, hosts=2, rate=rate, world=world)
    gradient = 16 << 20
    expected = 2 * (world - 1) / world * gradient / rate
    assert transport.time("allreduce:native", gradient) == pytest.approx(expected)
    assert link_bound_seconds("all_gather", gradient, world, rate) == pytest.approx(expected / 2)
    profile = _profile(params=(gradient // 4) // 4, sizes=(64 // world, 64))
    config = Configuration("DataParallel", world, (("allreduce", "native"),), dp=world, hosts=2)
    got = predict(config, profile, transport, 64)
    assert got.comm_s == pytest.approx(expected)  # the measured overlap is 0 here
    assert got.step_time_s == pytest.approx(got.compute_s + expected + 1e-6)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_keep_their_share_of_parameters_gradients_and_optimizer_state(stage, world):
    profile = _profile(sizes=(64 // world, 64))  # Adam in fp32: 4 + 4 + 8 bytes per parameter
    got = predict(Configuration("ShardedDataParallel", world, (("stage", stage),), dp=world), profile,
                  _transport(world=world), 64)  # fmt: skip
    p = profile.param_bytes
    # Between steps; loom's stage 1 frees the full gradient once its piece is averaged (sharded_flat).
    share = {1: (1, 1 / world, 1 / world), 2: (1, 1 / world, 1 / world), 3: (1 / world,) * 3}[stage]
    got_parts = [got.memory[k] for k in ("parameters", "gradients", "optimizer")]
    assert got_parts == [int(p * share[0]), int(p * share[1]), int(2 * p * share[2])]
    if stage > 1:  # loom's own statement of ZeRO's shares (its stage 1 counts the full gradient of backward)
        assert sum(got_parts) / (4 * p) == pytest.approx(zero_share(stage, world))


def test_a_size_measured_slower_than_a_larger_one_takes_the_larger_ones_time():
    inf = float("inf")
    # a spike at 100 KB (3 ms between 0.3 and 0.4 ms) is capped by 512 KB's time; nothing above a limit is invented
    assert envelope([3e-4, 3e-3, 4e-4, inf, inf]) == (3e-4, 4e-4, 4e-4, inf, inf)
    assert envelope([1e-4, 2e-4, 3e-4]) == (1e-4, 2e-4, 3e-4)  # increasing: unchanged
    assert envelope([]) == ()


def test_a_message_above_the_largest_measured_size_is_refused_not_extrapolated():
    transport = Transport(2, (8, 1024), {"allreduce:native": (1e-5, 2e-5)})
    assert transport.time("allreduce:native", 512) == pytest.approx(1e-5 + 1e-5 * (512 - 8) / (1024 - 8))
    with pytest.raises(OutsideCalibration, match="above the largest measured size 1024"):
        transport.time("allreduce:native", 4096)
    got = predict(Configuration("DataParallel", 2, (("allreduce", "native"),), dp=2), _profile(sizes=(32, 64)),
                  transport, 64)  # fmt: skip
    assert got.refused.startswith("outside the calibrated range")
    unmeasured = predict(Configuration("DataParallel", 2, (("allreduce", "native"),), dp=2), _profile(sizes=(64,)),
                         _transport(), 64)  # fmt: skip
    assert "batch size 32 was not measured" in unmeasured.refused


def test_every_configuration_is_ranked_with_a_reason_and_the_json_fields():
    profile = _profile(sizes=(16, 32, 64))
    configs = candidates(2, ("native", "ring"), 4, 64)
    preds = [predict(c, profile, _transport(1e-3), 64) for c in configs]
    ranked = rank(preds, memory_limit=None)
    assert len(ranked) == len(configs) and all(r.reason for r in ranked)
    assert ranked[0].reason.startswith("fastest predicted")
    doc = to_json(ranked, {"script": "x.py"})
    first = doc["configurations"][0]
    for key in ("strategy", "launch", "step_time_s", "samples_per_s", "memory_bytes_per_process", "feasible"):
        assert key in first
    assert first["strategy"].startswith("loom.") and first["launch"].startswith("-n 2")
    tp = next(row for row in doc["configurations"] if row["family"] == "TensorParallel")
    assert tp["feasible"] is False and "not predicted" in tp["reason"]
    ps = next(row for row in doc["configurations"] if row["family"] == "ParameterServer")
    assert ps["launch"] in ("-n 2 --servers 1", "-n 2 --servers 2")


def test_the_run_line_to_paste_carries_the_scripts_own_arguments_shell_quoted(monkeypatch, capsys):
    import loom.plan.planner
    from loom.cli import main

    profile = _profile(sizes=(16, 32, 64))
    ranked = rank(
        [predict(c, profile, _transport(1e-3), 64) for c in candidates(2, ("native",), 4, 64)], None
    )
    result = types.SimpleNamespace(ranked=ranked, top=ranked[0], global_batch_size=64)
    monkeypatch.setattr(loom.plan.planner, "plan", lambda *args: result)
    assert main(["plan", TINY, "dp", "a b", "[red]x", "data/[/x]"]) == 0  # brackets: text, not rich markup
    out = capsys.readouterr().out
    assert f"loom plan {shlex.join([TINY, 'dp', 'a b', '[red]x', 'data/[/x]'])}: 2 processes" in out
    assert (
        f"loom run {ranked[0].prediction.config.launch} {shlex.join([TINY, 'dp', 'a b', '[red]x', 'data/[/x]'])}\n"
        in out
    )


@pytest.mark.parametrize("memory_limit", [None, 1000])
def test_local_sgd_and_diloco_say_they_do_not_train_as_one_process(memory_limit):
    profile = _profile(sizes=(16, 32, 64))
    preds = [predict(c, profile, _transport(1e-3), 64) for c in candidates(2, ("native",), 4, 64)]
    for r in rank(preds, memory_limit):
        config = r.prediction.config
        apart = f"; replicas average every {config.option('sync_every')} steps: not equal to one process"
        assert (apart in r.reason) == (
            config.family in ("LocalSGD", "DiLoCo") and not r.prediction.refused
        ), r


def test_a_negative_engine_overhead_never_makes_a_step_time_zero_or_negative():
    """A negative overhead is the calibration's noise, bounded by half of its own step: a configuration whose
    formula step is smaller (more processes, a pipeline) must still be predicted positive, at half its step."""
    profile = _profile(sizes=(16, 32, 64))
    for c in candidates(2, ("native", "ring"), 4, 64):
        plain = predict(c, profile, _transport(), 64)
        if plain.refused:
            continue
        noisy = predict(c, profile, _transport(), 64, overhead_s=-1e6)
        assert noisy.step_time_s == plain.step_time_s / 2 and noisy.samples_per_s > 0, c
        slight = predict(c, profile, _transport(), 64, overhead_s=-plain.step_time_s / 4)
        assert slight.step_time_s == plain.step_time_s - plain.step_time_s / 4, c  # unclamped: as before


def test_an_impossible_memory_limit_is_one_clear_error():
    profile = _profile(sizes=(16, 32, 64))
    preds = [predict(c, profile, _transport(), 64) for c in candidates(2, ("native",), 4, 64)]
    ranked = rank(preds, memory_limit=1000)
    assert not any(r.feasible for r in ranked)
    assert next(r for r in ranked if r.prediction.config.family == "DataParallel").reason.startswith(
        "does not fit"
    )
    with pytest.raises(PlanError, match=r"no configuration fits --memory-per-proc 1000 bytes.*HINT"):
        check_fits(ranked, 1000)
    check_fits(rank(preds, memory_limit=1 << 30), 1 << 30)  # fits: no error


@pytest.mark.parametrize("text", ["10furlongs", "fast", "-1gbit", "0mbit", "gbit"])
def test_an_unknown_link_rate_is_refused_naming_it(text, capsys):
    with pytest.raises(ValueError, match=f"unknown link rate '{text}'.*HINT"):
        parse_rate(text)
    from loom.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["plan", "--hosts", "2", f"--link={text}", TINY])
    assert stop.value.code == 2
    assert "unknown link rate" in capsys.readouterr().err


def test_link_without_hosts_and_hosts_without_link_are_refused(capsys):
    from loom.cli import main

    assert main(["plan", "--link", "1gbit", TINY]) == 2
    assert "--link is the rate between hosts" in capsys.readouterr().err
    assert main(["plan", "--hosts", "2", TINY]) == 2
    assert "--hosts H needs the rate" in capsys.readouterr().err


def test_a_script_that_builds_no_model_is_one_clear_line(tmp_path, capsys):
    with pytest.raises(ScriptCaptureError, match=r"built no model: it never called strategy.setup.*HINT"):
        capture_script(TINY, ("--strategy", "none"))
    from loom.cli import main

    assert main(["plan", TINY, "--strategy", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "built no model" in err
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no data here')\n")
    with pytest.raises(ScriptCaptureError, match="raised RuntimeError: no data here before job.loader"):
        capture_script(broken)
    with pytest.raises(ScriptCaptureError, match="no such file"):
        capture_script(tmp_path / "missing.py")


def test_the_capture_sees_through_any_strategy_and_restores_setup():
    import loom

    before = loom.Pipeline.setup
    captured = capture_script(TINY, ("--strategy", "pipeline", "--batch", "48"))
    assert captured.strategy == "Pipeline" and captured.global_batch_size == 48
    assert len(captured.dataset) == 1024 and sum(p.numel() for p in captured.model.parameters()) > 0
    assert loom.Pipeline.setup is before


def test_the_profile_measures_each_layer_and_the_state_as_job_memory_counts_it():
    from loom.observe.memory import state_bytes

    captured = capture_script(TINY, ("--depth", "3"))
    profile = profile_model(captured, [16, 64], repeats=2)
    assert profile.chain and len(profile.at(64).layers) == 7  # 3 Linear + 3 ReLU + the head
    assert profile.param_bytes == state_bytes(captured.model, captured.optimizer)["parameters"]
    steps = 4 * len(list(captured.model.parameters()))  # Adam: two moments, and a float32 step per tensor
    assert profile.optimizer_bytes == 2 * profile.param_bytes + steps
    big, small = profile.at(64), profile.at(16)
    assert big.activation_bytes > small.activation_bytes > 0
    assert all(x.forward_s > 0 for x in big.layers) and sum(x.backward_s for x in big.layers) > 0
    assert big.layers[0].output_bytes == 64 * 64 * 4  # Linear(32, 64) on 64 samples, float32
    with pytest.raises(OutsideCalibration, match="batch size 32 was not measured"):
        profile.at(32)


def test_a_codec_is_measured_by_the_bytes_it_sends():
    captured = capture_script(TINY, ())
    grads = sum(p.numel() for p in captured.model.parameters())
    half = measure_codec("fp16", captured.model, 2, repeats=1)
    assert half.sum_bytes == 2 * grads and half.gather_bytes == 0 and half.seconds > 0


def test_pipeline_simulate_takes_one_time_per_stage():
    from loom.parallel.pipeline.pipeline_schedule import simulate

    equal = simulate("gpipe", 2, 4, [1.0, 1.0], [2.0, 2.0])
    assert equal.makespan == simulate("gpipe", 2, 4, 1.0, 2.0).makespan == (4 + 1) * 3.0
    slow_last = simulate("gpipe", 2, 4, [1.0, 2.0], [2.0, 4.0])
    assert slow_last.makespan == pytest.approx(1.0 + 4 * 6.0 + 2.0)  # fill, the slow stage's work, drain
    with pytest.raises(ValueError, match="one per stage"):
        simulate("gpipe", 2, 4, [1.0], 1.0)


def test_parse_bytes_reads_memory_sizes():
    from loom.plan.command import parse_bytes

    assert parse_bytes("8GiB") == 8 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("2GB") == 2e9
    with pytest.raises(argparse.ArgumentTypeError, match="HINT"):
        parse_bytes("lots")


def test_a_parameter_server_decodes_every_workers_push_and_encodes_every_reply_in_turn():
    world, frame = 4, 1e-3  # every frame costs 1 ms to encode and 1 ms to decode, whatever its size
    sizes = (8, 1 << 30)
    ops = {op: (0.0, 0.0) for op in ["allreduce:native", "all_gather", "reduce_scatter", "p2p"]}
    ops |= {"ps_encode": (frame, frame), "ps_decode": (frame, frame)}
    profile = _profile(sizes=(64 // world, 64))
    config = Configuration("ParameterServer", world, (("mode", "sync"),), servers=1, dp=world)
    unmeasured = predict(config, profile, Transport(world, sizes, ops), 64)
    assert "fixed cost per step was not measured" in unmeasured.refused
    got = predict(config, profile, Transport(world, sizes, ops, ps_fixed_s=0.0), 64)
    assert not got.refused, got.refused
    # push: one encode, then the server decodes 4 frames; reply: the server encodes 4, the worker decodes one
    assert got.comm_s == pytest.approx((1 + world) * frame + (world + 1) * frame)
    fixed = predict(config, profile, Transport(world, sizes, ops, ps_fixed_s=5e-3), 64)
    assert fixed.step_time_s - got.step_time_s == pytest.approx(5e-3)  # the measured round trips, once a step
    # each server writes its shard's checkpoint (parameters and optimizer state) after every step
    saving = predict(
        config, profile, Transport(world, sizes, ops, ps_fixed_s=0.0, ps_save_bytes_per_s=1e6), 64
    )
    state = profile.param_bytes + profile.optimizer_bytes
    assert saving.step_time_s - got.step_time_s == pytest.approx(state / 1e6)
    two = Configuration("ParameterServer", world, (("mode", "sync"),), servers=2, dp=world)
    halves = predict(two, profile, Transport(world, sizes, ops, ps_fixed_s=0.0, ps_save_bytes_per_s=1e6), 64)
    assert halves.step_time_s - predict(two, profile, Transport(world, sizes, ops, ps_fixed_s=0.0), 64).step_time_s \
        == pytest.approx(state / 2 / 1e6)  # fmt: skip
    # a worker holds its replies' decoded payloads and the frame being decoded: P (1 + 1/S) beyond its state
    assert got.memory["other"] == int(2 * profile.param_bytes)
    assert halves.memory["other"] == int(1.5 * profile.param_bytes)
    rate = parse_rate("100mbit")
    linked = predict(config, profile, Transport(world, sizes, ops, 0.0, 2, rate, ps_fixed_s=0.0), 64)
    assert linked.comm_s == pytest.approx(world * (profile.grad_bytes + profile.param_bytes) / rate)


def test_a_frame_above_the_measured_frame_sizes_is_refused_naming_the_limit():
    transport = Transport(2, (8, 1024, 4096), {"ps_encode": (1e-5, 2e-5, float("inf"))})
    assert transport.time("ps_encode", 1024) == pytest.approx(2e-5)
    with pytest.raises(OutsideCalibration, match="measured up to 1024 bytes, not 2048"):
        transport.time("ps_encode", 2048)


def test_kendall_tau_counts_pairs_in_the_same_order():
    from loom_bench.plan_accuracy import kendall_tau

    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


def test_the_predicted_peak_adds_the_steps_temporaries_and_the_process_runtime():
    import dataclasses

    profile = dataclasses.replace(_profile(layers=4, sizes=(32, 64)), transient_bytes=1000)
    dp = predict(Configuration("DataParallel", 2, (("allreduce", "native"),), dp=2), profile, _transport(), 64,
                 runtime_bytes=10**6)  # fmt: skip
    assert dp.memory["transient"] == 1000 and dp.memory["runtime"] == 10**6
    state = sum(dp.memory[k] for k in ("parameters", "gradients", "optimizer", "activations", "other"))
    assert dp.memory["total"] == state + 1000 + 10**6
    pipe = predict(Configuration("Pipeline", 2, (("stages", 2), ("microbatches", 2), ("schedule", "gpipe")), dp=1,
                                 pp=2), profile, _transport(), 64, runtime_bytes=10**6)  # fmt: skip
    assert (
        pipe.memory["transient"] == 500
    )  # a stage's temporaries in proportion to its half of the parameters


def test_tensor_parallel_splits_each_linear_pair_and_all_reduces_its_output_and_input_gradient():
    import dataclasses

    profile = dataclasses.replace(_profile(layers=4, sizes=(64,)), tp_pairs=((0, 1), (2, 3)), tp_refusal="")
    config = Configuration("TensorParallel", 2, (("size", 2),), dp=1, tp=2)
    got = predict(config, profile, _transport(seconds=1e-3), 64)
    assert not got.refused, got.refused
    assert got.compute_s == pytest.approx(4 * (1.0 + 2.0) / 2)  # every layer in a pair: half its work
    # forward: each pair's output; backward: the second pair's input (the first pair's input is the data)
    assert got.comm_s == pytest.approx(3 * 1e-3)
    assert got.memory["parameters"] == profile.param_bytes // 2
    assert (
        got.wire_bytes == 3 * (2 * (2 - 1) // 2) * 10 * 64
    )  # each all-reduce: a layer output of 10 B/sample
    unsplit = predict(config, _profile(layers=4, sizes=(64,)), _transport(), 64)
    assert unsplit.refused.endswith("not profiled")
    # one host: the all-reduce TensorParallelComm runs, shared memory in one barrier up to its size, loom's
    # shared-memory all-reduce above; the backend's only where neither was measured (across hosts)
    transport = _transport(seconds=1e-3)
    inf = float("inf")
    local = dataclasses.replace(
        transport,
        sizes=(8, 640, 1 << 30),
        seconds={**{k: (1e-3,) * 3 for k in transport.seconds}, "allreduce:shm": (2e-4,) * 3,
                 "small_allreduce": (5e-5, 5e-5, inf)},
    )  # fmt: skip
    assert predict(config, profile, local, 64).comm_s == pytest.approx(3 * 5e-5)  # 640-byte outputs: small
    above = dataclasses.replace(local, seconds={**local.seconds, "small_allreduce": (5e-5, inf, inf)},
                                sizes=(8, 320, 1 << 30))  # fmt: skip
    assert predict(config, profile, above, 64).comm_s == pytest.approx(3 * 2e-4)  # above its largest: shm


def test_the_profile_finds_the_linear_pairs_tensor_parallel_splits():
    captured = capture_script(TINY, ("--width", "16", "--depth", "3"))
    profile = profile_model(captured, [64], repeats=1)
    # Linear ReLU Linear ReLU Linear ReLU Linear: (0, 2) and (4, 6), as TensorParallel(plan="auto") splits them
    assert profile.tp_pairs == ((0, 2), (4, 6))


def test_fsdps_measured_cost_per_unit_is_added_once_per_unit():
    import dataclasses

    profile = _profile(layers=4, sizes=(32, 64))
    config = Configuration("ShardedDataParallel", 2, (("stage", 3),), dp=2)
    plain = predict(config, profile, _transport(), 64)
    charged = predict(config, profile, dataclasses.replace(_transport(), fsdp_unit_s={"stage3": 1e-3}), 64)
    assert charged.step_time_s - plain.step_time_s == pytest.approx(4 * 1e-3)  # 4 layers with parameters


def test_zero_stage_1_pays_its_measured_flat_copies_once_a_step():
    import dataclasses

    profile = _profile(layers=4, sizes=(32, 64))
    config = Configuration("ShardedDataParallel", 2, (("stage", 1),), dp=2)
    plain = predict(config, profile, _transport(), 64)
    copied = predict(config, dataclasses.replace(profile, flat_s=2e-3), _transport(), 64)
    assert copied.step_time_s - plain.step_time_s == pytest.approx(2e-3)


def test_the_profile_times_zero_stage_1s_copies_and_leaves_the_model_unchanged():
    import torch
    from torch import nn

    from loom.plan.profile import _flat_seconds

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    before = [p.detach().clone() for p in model.parameters()]
    assert _flat_seconds(model, 3) > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_fits_verdict_counts_the_launchers_share_and_the_peaks_error_margin():
    from loom.plan.recommend import MEMORY_MARGIN, needed_per_process

    profile = _profile(sizes=(32, 64))
    p = predict(Configuration("DataParallel", 2, (("allreduce", "native"),), dp=2), profile, _transport(), 64)
    needed = needed_per_process(p, job_share=1000)
    assert needed == int((p.memory["total"] + 1000) * (1 + MEMORY_MARGIN))
    assert rank([p], memory_limit=needed, job_share=1000)[0].feasible
    below = rank([p], memory_limit=needed - 1, job_share=1000)[0]
    assert not below.feasible and "share of the launcher's" in below.reason


def test_replica_sync_buffers_and_fsdps_measured_memory_are_counted():
    """LocalSGD holds one flat copy of the parameters during its average; DiLoCo its anchor, outer momentum,
    pseudo-gradient and its flat copy; ZeRO-1 a flat copy of the gradient; ZeRO-2/3 their measured memory beyond
    the formula (``R_z``) and no other configuration does."""
    profile = _profile(sizes=(32, 64))
    p = profile.param_bytes

    def other(family: str, options: tuple, extra: int = 0) -> int:
        config = Configuration(family, 2, options, dp=2)
        return predict(config, profile, _transport(), 64, fsdp_extra=extra).memory["other"]

    assert other("LocalSGD", (("sync_every", 8),)) == p
    assert other("DiLoCo", (("sync_every", 8),)) == 4 * p
    assert other("ShardedDataParallel", (("stage", 2),), 123) == 123
    assert other("ShardedDataParallel", (("stage", 3),), 123) == 123
    assert other("ShardedDataParallel", (("stage", 3),)) == 0
    assert other("ShardedDataParallel", (("stage", 1),), 123) == profile.grad_bytes  # its flat gradient
    assert other("DataParallel", (("allreduce", "native"),), 123) == 0


def test_sizes_a_hair_apart_are_measured_once_at_the_larger_and_the_limits_follow():
    from loom.plan.planner import coalesce

    sizes = [8, 1000, 67_000_000, 168_165_396, 168_824_328, 336_000_000]
    limits = {"ps": 168_165_396, "all_gather": 168_824_328, "p2p": 1000}
    kept, raised = coalesce(sizes, limits, cap=1 << 40)
    assert kept == [8, 1000, 67_000_000, 168_824_328, 336_000_000]
    assert raised == {"ps": 168_824_328, "all_gather": 168_824_328, "p2p": 1000}
    # never across a parameter server's largest frame: the size below it stays measured, its limit too
    kept, raised = coalesce(sizes, limits, cap=168_500_000)
    assert kept == sizes and raised == limits


@pytest.mark.parametrize("allreduce_s", [4.0, 6.0, 9.0])
def test_the_overlap_comes_from_the_reference_and_the_quiet_run_and_moves_only_what_overlaps(allreduce_s):
    # The calibration's two engine runs on 2 processes: DataParallel(native) 20 s a step, the same with no
    # exchange 15 s; compute 12 s (backward 8 s), no optimizer time, every operation X s at every size (the small
    # all-reduce e too). Whatever X the transport measured, the reference and the quiet run are predicted as
    # measured, and the ring (no overlap) moves only by its own all-reduce, not through the overhead.
    from loom.plan.planner import _overhead, _with_overlap
    from loom.plan.trial import QUIET

    profile, measured = _profile(sizes=(32, 64)), {"reference_step_s": 20.0, "quiet_step_s": 15.0}
    reference = Configuration("DataParallel", 2, (("allreduce", "native"),), dp=2)
    quiet = Configuration("LocalSGD", 2, (("sync_every", QUIET),), dp=2)
    transport = _with_overlap(_transport(seconds=allreduce_s), measured, profile, reference, 64)
    assert transport.overlap == pytest.approx((allreduce_s - 5.0) / min(allreduce_s, 8.0))
    overhead = _overhead(measured["quiet_step_s"], predict(quiet, profile, transport, 64))
    assert overhead == pytest.approx(15.0 - (12.0 + allreduce_s + allreduce_s / QUIET))  # C + O + e, X / H
    assert predict(reference, profile, transport, 64, overhead_s=overhead).step_time_s == pytest.approx(20.0)
    assert predict(quiet, profile, transport, 64, overhead_s=overhead).step_time_s == pytest.approx(15.0)
    ring = Configuration("DataParallel", 2, (("allreduce", "ring"),), dp=2)
    assert predict(ring, profile, transport, 64, overhead_s=overhead).step_time_s == pytest.approx(
        15.0 + allreduce_s
    )
    hidden = _with_overlap(_transport(seconds=1.0), {"reference_step_s": 30.0, "quiet_step_s": 15.0}, profile,
                           reference, 64)  # fmt: skip
    assert hidden.overlap == -1.0  # 15 s exposed of a 1 s all-reduce: at most the all-reduce added again
    assert hidden.ddp_extra_s == pytest.approx(13.0)  # the rest, 15 - (1 + 1), is native DDP's own
    overhead = _overhead(15.0, predict(quiet, profile, hidden, 64))
    # the reference is predicted as measured; the ring does not pay DDP's extra
    assert predict(reference, profile, hidden, 64, overhead_s=overhead).step_time_s == pytest.approx(30.0)
    assert predict(ring, profile, hidden, 64, overhead_s=overhead).step_time_s == pytest.approx(16.0)
    assert Transport.from_json(hidden.to_json()).ddp_extra_s == hidden.ddp_extra_s


def test_a_quiet_run_faster_than_its_formula_corrects_every_configuration_down_at_most_by_half():
    from loom.plan.planner import _overhead
    from loom.plan.trial import QUIET

    quiet = predict(
        Configuration("LocalSGD", 2, (("sync_every", QUIET),), dp=2), _profile(), _transport(), 64
    )
    assert _overhead(quiet.step_time_s - 1.0, quiet) == pytest.approx(-1.0)
    assert _overhead(0.0, quiet) == pytest.approx(-quiet.step_time_s / 2)


def test_the_calibration_times_the_widest_pipeline_with_the_fewest_microbatches_and_predicts_it_as_measured():
    from loom.plan.planner import _overhead, _pipeline_probe

    probe = _pipeline_probe(4, True, 8, 64)
    assert probe is not None
    assert (probe.family, probe.pp, probe.option("microbatches"), probe.option("schedule")) == (
        "Pipeline", 4, 2, "gpipe"
    )  # fmt: skip
    assert _pipeline_probe(4, False, 8, 64) is None  # not a chain: no Pipeline to time
    hybrid = _pipeline_probe(4, True, 3, 64)  # a chain of 3 layers: 2 stages at most of 4 processes
    assert hybrid is not None and (hybrid.family, hybrid.dp, hybrid.pp) == ("Hybrid", 2, 2)
    profile = _profile(layers=8, sizes=(16, 64))
    replay = predict(probe, profile, _transport(), 64)
    overhead = _overhead(replay.step_time_s + 0.5, replay)
    assert predict(probe, profile, _transport(), 64, overhead_s=overhead).step_time_s == pytest.approx(
        replay.step_time_s + 0.5
    )


def test_transport_rounds_take_one_call_of_each_operation_a_round_each_timed_right_after_an_untimed_one():
    """`measure_transport`'s rounds (`INTERLEAVED_BYTES`): a phase of a slow host falls on every size's calls
    alike, not on consecutive calls of one size; every rank makes the same calls. A parameter server's frame past
    its first size counts its first call as a sample (no warm-up)."""
    from threads import run_ranks

    from loom.plan.transport_timing import _complete, _first_call

    def rank_fn(rank: int, group) -> tuple[list[str], list[int], int]:
        calls: list[str] = []

        def op(tag: str):
            return lambda: calls.append(tag)

        timings = [
            _first_call("a", 0, op("a"), 3, group, [], True),
            _first_call("b", 1, op("b"), 1, group, [], True),
        ]
        frame = _first_call("ps_encode", 2, op("f"), 3, group, [timings[0]], False)
        again = _first_call("ps_encode", 3, op("f"), 3, group, [frame], False)
        calls.clear()
        _complete(timings, group, rounds=True)
        return calls, [len(t.seconds) for t in timings], len(again.seconds)

    for calls, counts, frame_samples in run_ranks(2, rank_fn):
        assert calls == ["a", "a", "b", "b", "a", "a", "a", "a"]
        assert counts == [3, 1]
        assert frame_samples == 1


def test_transport_measuring_order_times_large_sizes_at_once_and_small_frames_after_every_collective():
    """`_in_order`: collectives up to `INTERLEAVED_BYTES` wait for the rounds (None), larger ones are timed at
    once with their frames right after them; the small sizes' frames come after the rounds; every family stops
    at its limit."""
    from loom.plan.transport_timing import INTERLEAVED_BYTES, _in_order

    small, large = 4096, 2 * INTERLEAVED_BYTES

    def operations(size: int) -> dict:
        return {name: (name, size) for name in ("allreduce:ring", "p2p", "ps_encode", "ps_decode")}

    order = [
        None if call is None else (call[0], call[1], call[3])
        for call in _in_order([small, large], {"p2p": small, "ps": large}, operations)
    ]
    assert order == [
        (0, "allreduce:ring", False),
        (0, "p2p", False),
        (1, "allreduce:ring", True),
        (1, "ps_encode", True),
        (1, "ps_decode", True),
        None,
        (0, "ps_encode", True),
        (0, "ps_decode", True),
    ]


def test_transport_json_is_plain_and_round_trips_unmeasured_sizes():
    """`Transport.to_json` writes an unmeasured size as null (strict JSON readers refuse ``Infinity``), and
    `from_json` reads it back as unmeasured, which `Transport.time` refuses."""
    import json

    measured = Transport(2, (8, 4096), {"p2p": (1e-4, math.inf)}, 0.5, ps_fixed_s=0.002)
    text = json.dumps(measured.to_json())
    assert "Infinity" not in text and "null" in text
    again = Transport.from_json(json.loads(text))
    assert again == measured
    with pytest.raises(OutsideCalibration):
        again.time("p2p", 4096)
