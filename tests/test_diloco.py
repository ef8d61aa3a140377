"""DiLoCo: ``sync_every=1`` with inner SGD and an outer SGD of lr 1 equals DataParallel and one process (uneven and
empty shares included); with fragments every parameter is synchronized once per ``sync_every`` steps, each
exchange applied a fixed number of steps after it was sent; compression sends fewer bytes, stays close and is
not exact; resumed in new processes mid-interval, with a fragment in flight, it equals a straight run bitwise.

Workers: tests/workers/local_sgd_exact.py and tests/workers/local_sgd_fit.py, launched once for this file and
tests/test_local_sgd.py (see `exact_runs`, `fit_runs` there).
"""

from __future__ import annotations

import pytest
import torch
from test_local_sgd import assert_close, assert_resumed_bitwise, exact_runs, fit_runs
from torch import nn
from workers.common import make_dataset, make_mlp

import loom
from loom.comm.compression.int8 import INT8_CHUNK, dequantize_int8, quantize_int8
from loom.parallel.replica.diloco import split_fragments
from loom.topology import Topology

SINGLE = Topology(0, 1, 0, 1, "none")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_sync_every_step_with_outer_sgd_lr_1_equals_data_parallel_and_one_process(world_size):
    runs = exact_runs(world_size)
    reference = runs["reference"][0]
    for record, dp in zip(runs["diloco"], runs["dp"], strict=True):
        assert_close(record, reference, 1e-5, f"DiLoCo rank {record['rank']} vs one process")
        assert_close(record, dp, 1e-5, f"DiLoCo rank {record['rank']} vs DataParallel")
    # compressed outer gradients: close to exact, but not exact (the codec really ran)
    for compression, tol in (("fp16", 1e-3), ("bf16", 1e-2), ("int8", 1e-2)):
        for record in runs[f"diloco_{compression}"]:
            assert_close(record, reference, tol, f"DiLoCo {compression} rank {record['rank']}")
            with pytest.raises(AssertionError):
                assert_close(record, reference, 1e-7, "")


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 4])
def test_fragments_synchronize_every_parameter_once_per_interval(world_size):
    h, steps = 4, 13
    for record in exact_runs(world_size)["fragments"]:
        fragments = record["names"]
        assert len(fragments) == 2 and sorted(sum(fragments, [])) == sorted(record["all"])
        log = [tuple(entry) for entry in record["log"]]
        assert all(applied == sent + 1 for _, sent, applied in log), log  # one step of overlap, exactly
        for name in record["all"]:
            k = next(i for i, names in enumerate(fragments) if name in names)
            sent = [s for fragment, s, _ in log if fragment == k]
            per_interval = [sum(1 for s in sent if i * h < s <= (i + 1) * h) for i in range(steps // h)]
            assert per_interval == [1, 1, 1], f"rank {record['rank']}: {name} sent at steps {sent}"
        assert {s % h for _, s, _ in log} == {0, 2}  # staggered: fragment k at step % 4 == k * 4 / 2


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_compressed_exchanges_send_fewer_bytes():
    world = 2
    (none,), (fp16,), (bf16,), (int8,) = ([r for r in exact_runs(world)[f"bytes_{c}"] if r["rank"] == 0]
                                          for c in ("None", "fp16", "bf16", "int8"))  # fmt: skip
    numel = none["numel"]
    assert none["sent"] == 2 * (world - 1) * 4 * numel // world  # the native all-reduce's ring estimate
    assert fp16["sent"] == bf16["sent"] == 2 * (world - 1) * 2 * numel // world
    chunks = -(-numel // INT8_CHUNK)
    assert int8["sent"] == (world - 1) * (chunks * INT8_CHUNK + 4 * chunks)
    assert int8["sent"] < none["sent"] / 3


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["diloco", "streaming"])
def test_resumed_mid_interval_in_new_processes_equals_a_straight_run_bitwise(name):
    assert_resumed_bitwise(name, 2)
    if name == "streaming":  # the checkpoint of step 10 held an exchange in flight
        first, _ = fit_runs(2)
        assert [r["in_flight"] for r in first["streaming=streaming-half:10"]] == [1, 1]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_int8_codes_round_trip_within_half_a_step_per_chunk():
    values = torch.randn(3 * INT8_CHUNK + 5, generator=torch.Generator().manual_seed(0))
    values[:INT8_CHUNK] *= 1000  # chunks have their own scales
    codes, scales = quantize_int8(values)
    back = dequantize_int8(codes, scales)[: values.numel()]
    step = scales.repeat_interleave(INT8_CHUNK)[: values.numel()]
    assert ((back - values).abs() <= step / 2 + 1e-6).all()
    assert codes.dtype == torch.int8 and scales.numel() == 4


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_fragments_are_contiguous_balanced_and_never_empty():
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 3) == [[0], [1], [2, 3]]
    assert split_fragments([1, 1, 100], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="fragments=4 but the model has only 3 parameter tensor"):
        split_fragments([1, 2, 3], 4)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_one_process_matches_an_outer_step_written_out():
    """One replica, H=2: after every second Adam step the outer Nesterov SGD moves the global copy by the
    pseudo-gradient, and the model takes the global copy; written out here with torch alone."""
    data = make_dataset()
    model, plain = make_mlp(), make_mlp()
    job = loom.DiLoCo(sync_every=2, topology=SINGLE, observe=False).setup(
        model, torch.optim.Adam(model.parameters(), lr=0.01), nn.functional.mse_loss
    )
    inner = torch.optim.Adam(plain.parameters(), lr=0.01)
    held = [p.detach().clone() for p in plain.parameters()]
    outer = torch.optim.SGD(held, lr=0.7, momentum=0.9, nesterov=True)
    for step, batch in enumerate(job.loader(data, 8, seed=2), start=1):
        job.train_step(batch)
        inner.zero_grad()
        nn.functional.mse_loss(plain(batch[0]), batch[1]).backward()
        inner.step()
        if step % 2 == 0:
            for g, p in zip(held, plain.parameters(), strict=True):
                g.grad = g - p.detach()
            outer.step()
            with torch.no_grad():
                for g, p in zip(held, plain.parameters(), strict=True):
                    p.copy_(g)
    assert [s for _, s, _ in job.sync_log] == [2, 4]
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    job.synchronize()  # one more outer step; afterwards the model is the global copy
    for a, g in zip(model.parameters(), job.global_params, strict=True):
        assert torch.equal(a, g)


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"sync_every": 0}, ValueError, "sync_every must be an int >= 1, got 0"),
        ({"sync_every": 10, "fragments": 4}, ValueError, "sync_every=10 is not a multiple of fragments=4"),
        ({"fragments": 0}, ValueError, "fragments must be an int >= 1, got 0"),
        (
            {"compression": "int4"},
            ValueError,
            "unknown or invalid gradient codec spec 'int4'; valid forms are fp16",
        ),
        (
            {"compression": "powersgd:2"},
            ValueError,
            "DiLoCo cannot use powersgd:2 (its error feedback and warm start keep state across steps; the outer "
            "exchange has none); it takes fp16, bf16, int8",
        ),
        (
            {"compression": "TopK:0.1"},
            ValueError,
            "DiLoCo cannot use topk:0.1 (its error feedback keeps a residual per gradient across steps; the outer "
            "exchange has none); it takes fp16, bf16, int8",
        ),
        ({"sync_every": 4, "overlap_steps": 4}, ValueError, "overlap_steps=4 must be an int from 0 to"),
        ({"compression": "int8", "allreduce": "ring"}, ValueError, "compression='int8' all-gathers"),
        (
            {"outer_optimizer": torch.optim.SGD([torch.zeros(1)], lr=1)},
            TypeError,
            "outer_optimizer must be a",
        ),
    ],
)
def test_bad_options_are_named(options, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        loom.DiLoCo(**options)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_compression_takes_the_one_vocabulary_in_its_canonical_form():
    for spec, canonical in (("fp16", "fp16"), (" BF16 ", "bf16"), ("Int8", "int8"), (None, None)):
        assert loom.DiLoCo(compression=spec).config.compression == canonical


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_int8_keeps_buffers_out_of_the_pseudo_gradients_chunks():
    """Fragment 0 carries the buffers as values (a BatchNorm running variance of ~900 here); under int8 they must
    not share a chunk, and so a scale, with the small pseudo-gradients, which would round those to 0."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(30 * torch.randn(64, 6), torch.randn(64, 1))

    def outer_step(compression):
        """The global copy's move in the first outer step, and the buffers sent with it."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 9), nn.BatchNorm1d(9), nn.Linear(9, 1))  # 91 values: one chunk
        job = loom.DiLoCo(sync_every=2, compression=compression, topology=SINGLE, observe=False).setup(
            model, torch.optim.SGD(model.parameters(), lr=1e-4), nn.functional.mse_loss
        )
        start = [g.detach().clone() for g in job.global_params]
        for step, batch in enumerate(job.loader(data, 16, seed=0), start=1):
            job.train_step(batch)
            if step == 2:
                break
        moves = torch.cat([(g.detach() - s).flatten() for g, s in zip(job.global_params, start, strict=True)])
        return moves, dict(model.named_buffers())

    exact, buffers = outer_step(None)
    assert buffers["1.running_var"].max() > 50  # large values travel beside the pseudo-gradients
    quantized, _ = outer_step("int8")
    assert exact.abs().max() > 0
    # The pseudo-gradients' chunk has its own scale: each move within half a step of it (outer lr 0.7 and
    # Nesterov's 1.9 included in the move), not rounded to 0 by the buffers' scale.
    assert (quantized - exact).abs().max() <= exact.abs().max() / 127 * 1.01
