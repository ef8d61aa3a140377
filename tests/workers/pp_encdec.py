"""Pipeline on 2 processes: an encoder–decoder split between the stages, and a split balanced by measured time.

Run as a worker (``pp_encdec.py STEPS`` on 2 ranks): prints one JSON line per configuration with this rank's
losses, the layers of its stage and (rank 0) the full parameters after training. One launch covers every
configuration. Imported by the test (as ``workers.pp_encdec``) for the models and the single-process reference.

The encoder–decoder is a chain ``encoder → decoder → head``; the encoder returns the tuple ``(memory, src_mask,
dec_in)`` — a float tensor with a gradient, a bool mask, and the decoder's input data, which has no gradient on
the encoder's stage — and the decoder takes the three as positional arguments (`PipelineStage` unpacks tuples).

Run by tests/test_pipeline_encdec.py.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn

try:  # worker script (tests/workers on the path) or imported by a test (as workers.pp_encdec)
    from common import make_dataset, make_optimizer
except ImportError:
    from workers.common import make_dataset, make_optimizer

from loom.data import GlobalBatchSampler

N_SAMPLES = 37
SRC_LEN, TGT_LEN, FEATURES, HIDDEN, OUT = 5, 3, 4, 8, 2
GLOBAL_BATCH = 10
SEED = 1


# -- the encoder–decoder ------------------------------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor, dec_in: torch.Tensor) -> tuple:
        memory = torch.tanh(self.mix(torch.tanh(self.proj(src))))
        return memory, src_mask, dec_in


class Decoder(nn.Module):
    """Each target position attends over the encoder's memory (masked positions left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, HIDDEN)
        # No key bias: softmax ignores it, so its gradient would be rounding noise, which Adam amplifies.
        self.key = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.value = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, memory: torch.Tensor, src_mask: torch.Tensor, dec_in: torch.Tensor) -> torch.Tensor:
        q = self.embed(dec_in)  # (n, T, H)
        scores = q @ self.key(memory).transpose(1, 2) / HIDDEN**0.5  # (n, T, S)
        scores = scores.masked_fill(~src_mask[:, None, :], float("-inf"))
        return torch.tanh(q + scores.softmax(-1) @ self.value(memory))


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor, dec_in: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(*self.encoder(src, src_mask, dec_in)))


def make_encdec() -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder()


def make_seq_data(n: int = N_SAMPLES) -> tuple[torch.Tensor, ...]:
    """``(src, src_mask, dec_in, target)``; every source keeps at least 2 unmasked positions."""
    g = torch.Generator().manual_seed(7)
    src = torch.randn(n, SRC_LEN, FEATURES, generator=g)
    lengths = torch.randint(2, SRC_LEN + 1, (n,), generator=g)
    src_mask = torch.arange(SRC_LEN)[None, :] < lengths[:, None]
    dec_in = torch.randn(n, TGT_LEN, FEATURES, generator=g)
    target = torch.randn(n, TGT_LEN, OUT, generator=g)
    return src, src_mask, dec_in, target


def seq_batches(steps: int) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """The first ``steps`` global batches ``((src, src_mask, dec_in), target)`` (crossing epochs)."""
    data = make_seq_data()
    sampler = GlobalBatchSampler(N_SAMPLES, GLOBAL_BATCH, seed=SEED)
    out: list = []
    while len(out) < steps:
        for batch in sampler:
            src, mask, dec_in, target = (t[batch.indices] for t in data)
            out.append(((src, mask, dec_in), target))
            if len(out) == steps:
                break
    return out


def encdec_reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final parameters of the unsplit encoder–decoder trained with Adam in one process."""
    model = make_encdec()
    opt = make_optimizer("adam", model)
    losses = []
    for inputs, target in seq_batches(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(*inputs), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- a chain whose slow layer (by time, not by parameters) depends on the rank ---------------------------------
SLOW_S = 0.02


class SlowTanh(nn.Tanh):
    """Tanh that sleeps while ``active`` if it is the slow layer of this rank: rank 0's timings differ from rank
    1's, so the processes only agree on the cut if rank 0's is broadcast."""

    active = False

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = int(os.environ.get("RANK", "0"))
        if SlowTanh.active and self.index == {0: 5, 1: 1}.get(rank):
            time.sleep(SLOW_S)
        return super().forward(x)


def make_slow_mlp() -> nn.Sequential:
    """`pp_common.make_deep_mlp` (same parameters, same names) with `SlowTanh` activations at 1, 3 and 5."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        SlowTanh(1),
        nn.Linear(16, 16),
        SlowTanh(3),
        nn.Linear(16, 16),
        SlowTanh(5),
        nn.Linear(16, 4),
    )


# -- the worker -----------------------------------------------------------------------------------------------
def _train(job, batches: list) -> list[float]:
    return [job.train_step(batch) for batch in batches]


def _record(job, kind: str, schedule: str, m: int, losses: list[float], **extra) -> None:
    full = job.full_state_dict()
    record = {
        "kind": kind,
        "schedule": schedule,
        "m": m,
        "losses": losses,
        "layers": job.module.layer_names,
        "all_layers": job.layer_names,
        "params": {k: v.flatten().tolist() for k, v in full.items()} if full is not None else None,
        **extra,
    }
    print(json.dumps(record), flush=True)


def main(steps: int) -> None:
    import loom
    from loom.mesh import Mesh
    from loom.parallel.pipeline.pipeline import Pipeline

    topo = loom.init()
    assert topo.world_size == 2, "pp_encdec.py runs on 2 processes"
    mesh = Mesh(pp=2)
    batches = seq_batches(steps)
    src, mask, dec_in, _ = make_seq_data()
    for schedule in ("gpipe", "1f1b"):
        for m in (1, 2):
            # Encoder on rank 0, decoder (and head) on rank 1: the tuple crosses between the processes.
            model = make_encdec()
            job = Pipeline(stages=2, microbatches=m, schedule=schedule, split=["decoder"], mesh=mesh).setup(
                model, make_optimizer("adam", model), nn.functional.mse_loss
            )
            losses = _train(job, batches)
            eval_loss = job.eval_step(((src, mask, dec_in), make_seq_data()[3]))["loss"]
            _record(job, "encdec", schedule, m, losses, eval=eval_loss)

        # The encoder–decoder balanced by measured time: `_layer_times` times tuple-passing layers.
        model = make_encdec()
        sample = tuple(t[:GLOBAL_BATCH] for t in (src, mask, dec_in))
        job = Pipeline(
            stages=2, microbatches=2, schedule=schedule, balance_by="time", sample_input=sample, mesh=mesh
        ).setup(model, make_optimizer("adam", model), nn.functional.mse_loss)
        _record(job, "encdec_time", schedule, 2, _train(job, batches))

        # The deep MLP balanced by time, with a slow parameter-free layer that differs between the ranks.
        data = make_dataset()
        model = make_slow_mlp()
        SlowTanh.active = True
        job = Pipeline(
            stages=2,
            microbatches=2,
            schedule=schedule,
            balance_by="time",
            sample_input=data.tensors[0][:GLOBAL_BATCH],
            mesh=mesh,
        ).setup(model, make_optimizer("adam", model), nn.functional.mse_loss)
        SlowTanh.active = False
        sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=SEED)
        mlp_batches: list = []
        while len(mlp_batches) < steps:
            for batch in sampler:
                mlp_batches.append(data[batch.indices])
                if len(mlp_batches) == steps:
                    break
        _record(job, "mlp_time", schedule, 2, _train(job, mlp_batches))


if __name__ == "__main__":
    main(int(sys.argv[1]))
