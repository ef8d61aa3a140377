"""PyTorch's pipelining tutorial's ``Transformer`` (layers in a ``ModuleDict``, each called ``layer(h, h)``)
given to ``Pipeline(stages=2)`` and to ``TensorParallel(size=2)``.

``idioms_pipeline.py``: prints ``pipeline: refused at setup: <the error>`` (or ``pipeline: trained`` /
``pipeline: failed at the first step: ...``), then ``tensor parallel loss <the first step's loss>``: tensor
parallelism runs the model's own forward, so it needs no chain. Run by tests/test_idioms.py at 2 processes.
"""

from __future__ import annotations

import torch
from torch import nn

import loom

VOCAB = 32


def model_and_data():
    from test_idioms import TutorialTransformer  # tests/ is on the path: the script's directory's parent

    torch.manual_seed(0)
    model = TutorialTransformer(vocab_size=VOCAB, dropout=0.0)
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randint(0, VOCAB, (4, 8), generator=generator),
        torch.randint(0, VOCAB, (4, 8), generator=generator),
    )
    return model, data


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def main() -> None:
    loom.init()
    model, data = model_and_data()
    try:
        job = loom.Pipeline(stages=2).setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    except ValueError as error:
        print(f"pipeline: refused at setup: {error}", flush=True)
    else:
        try:
            for batch in job.loader(data, 4):
                job.train_step(batch)
            print("pipeline: trained", flush=True)
        except Exception as error:  # what happened before: torch's NotImplementedError at the first step
            print(f"pipeline: failed at the first step: {type(error).__name__}: {error}", flush=True)
    model, data = model_and_data()
    job = loom.TensorParallel(size=2).setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    for batch in job.loader(data, 4):
        print(f"tensor parallel loss {float(job.train_step(batch)):.7f}", flush=True)


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
