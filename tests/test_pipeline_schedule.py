"""Schedules as data: instruction streams, liveness and bubble checked without processes; splitting a model."""

import pytest
import torch
from torch import nn

from loom.parallel.pipeline.pipeline import Pipeline, PipelineConfig
from loom.parallel.pipeline.pipeline_schedule import (
    Instruction,
    Op,
    bubble_fraction,
    compute_order,
    peak_live_microbatches,
    simulate,
    stage_instructions,
)
from loom.parallel.pipeline.pipeline_split import balanced_cuts, chain_layers, cuts_from_names
from loom.topology import Topology

pytestmark = pytest.mark.unit

CONFIGS = [(p, m) for p in (1, 2, 4) for m in (1, 2, 4, 8)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("stages", "microbatches"), CONFIGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_every_microbatch_once_forward_before_backward(schedule, stages, microbatches):
    for s in range(stages):
        order = compute_order(schedule, s, stages, microbatches)
        assert sorted(order) == sorted(
            [("F", j) for j in range(microbatches)] + [("B", j) for j in range(microbatches)]
        )
        assert all(order.index(("F", j)) < order.index(("B", j)) for j in range(microbatches))


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("stages", "microbatches"), CONFIGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("forward_time", "backward_time"), [(1.0, 1.0), (1.0, 2.0)])
def test_simulated_bubble_is_theoretical(schedule, stages, microbatches, forward_time, backward_time):
    result = simulate(schedule, stages, microbatches, forward_time, backward_time)
    assert result.bubble == pytest.approx(bubble_fraction(stages, microbatches), abs=1e-12)
    assert result.makespan == pytest.approx((microbatches + stages - 1) * (forward_time + backward_time))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
def test_message_time_adds_the_critical_path_messages(microbatches):
    """GPipe pays for the 2(p - 1) messages of its ramp up and down, whatever m is; 1F1B with p = 2 pays for
    max(2, m): its steady state alternates forwards and backwards with no slack, so its messages add up."""
    c = 0.01
    for stages in (2, 3, 4):
        free = simulate("gpipe", stages, microbatches).makespan
        assert simulate("gpipe", stages, microbatches, message_time=c).makespan == pytest.approx(
            free + 2 * (stages - 1) * c
        )
    free = simulate("1f1b", 2, microbatches).makespan
    paid = simulate("1f1b", 2, microbatches, message_time=c)
    assert paid.makespan == pytest.approx(free + max(2, microbatches) * c)
    assert paid.bubble > bubble_fraction(2, microbatches)
    with pytest.raises(ValueError, match="message_time"):
        simulate("1f1b", 2, microbatches, message_time=-c)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("stages", "microbatches"), CONFIGS)
def test_liveness_gpipe_keeps_m_1f1b_at_most_p(stages, microbatches):
    for s in range(stages):
        gpipe = peak_live_microbatches(stage_instructions("gpipe", s, stages, microbatches))
        one_f_one_b = peak_live_microbatches(stage_instructions("1f1b", s, stages, microbatches))
        assert gpipe == microbatches
        assert one_f_one_b == min(microbatches, stages - s) <= stages


@pytest.mark.timeout(10)
def test_instruction_streams_of_a_middle_stage():
    stream = stage_instructions("1f1b", 1, 3, 3)
    F, B = Op.FORWARD, Op.BACKWARD
    RA, SA, RG, SG = Op.RECV_ACTIVATION, Op.SEND_ACTIVATION, Op.RECV_GRADIENT, Op.SEND_GRADIENT
    expected = [(RA, 0), (F, 0), (SA, 0), (RA, 1), (F, 1), (SA, 1), (RG, 0), (B, 0), (SG, 0), (RA, 2), (F, 2)]
    expected += [(SA, 2), (RG, 1), (B, 1), (SG, 1), (RG, 2), (B, 2), (SG, 2)]
    assert stream == [Instruction(op, j) for op, j in expected]
    first_eval = stage_instructions("gpipe", 0, 2, 2, forward_only=True)
    assert first_eval == [Instruction(F, 0), Instruction(SA, 0), Instruction(F, 1), Instruction(SA, 1)]


@pytest.mark.timeout(10)
def test_balanced_cuts_minimise_the_heaviest_stage():
    assert balanced_cuts([1, 1, 1, 1], 2) == [2]
    assert balanced_cuts([4, 1, 1, 1, 1], 2) == [1]
    assert balanced_cuts([1, 2, 3, 4, 5, 6], 3) == [3, 5]
    assert balanced_cuts([1, 1, 1], 3) == [1, 2]


def _encoder_decoder() -> nn.Module:
    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 8)
            self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            self.decoder = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
            self.head = nn.Linear(8, 2)

    return EncoderDecoder()


@pytest.mark.timeout(10)
def test_chain_expands_containers_and_names_split_points():
    layers = chain_layers(_encoder_decoder())
    assert [n for n, _ in layers] == ["embed", "encoder.0", "encoder.1", "decoder.0", "decoder.1", "head"]
    assert cuts_from_names(layers, ["decoder.0"], 2) == [3]
    with pytest.raises(ValueError, match=r"split point 'decoder' is not a layer.*'decoder.0'"):
        cuts_from_names(layers, ["decoder"], 2)
    with pytest.raises(ValueError, match="cannot split 6 layers into 7 pipeline stages"):
        cuts_from_names(layers, ["a"] * 6, 7)
    with pytest.raises(ValueError, match="more stages than layers"):
        balanced_cuts([1.0] * 6, 8)


@pytest.mark.timeout(10)
def test_bad_configuration_errors_name_the_values():
    with pytest.raises(ValueError, match="schedule must be one of 'gpipe', '1f1b', got 'zb'"):
        PipelineConfig(stages=2, schedule="zb")
    with pytest.raises(ValueError, match="microbatches must be an int >= 1, got 0"):
        PipelineConfig(stages=2, microbatches=0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    single = Topology(0, 1, 0, 1, "none")
    with pytest.raises(ValueError, match=r"Pipeline\(stages=2\) does not divide the world size 1"):
        Pipeline(stages=2, topology=single).setup(
            model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss()
        )
    with pytest.raises(ValueError, match='balance_by="time" needs sample_input'):
        Pipeline(stages=1, balance_by="time", topology=single)
