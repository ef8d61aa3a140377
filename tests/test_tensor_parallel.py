"""Tensor parallel (t = 2) equals the unsplit blocks; collectives counted; bad sizes refused with the values."""

import json

import pytest
import torch
from torch import nn

from loom.examples.char_gpt import Block, CharGPT
from loom.parallel.tensor.tensor_parallel_layers import TensorParallelComm
from loom.parallel.tensor.tensor_parallel_shard import TensorParallelConfig, apply_tensor_parallel, auto_plan


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_blocks_match_unsplit_and_count_collectives(workers):
    outputs = workers("tp_exact.py", 2, timeout=55)
    expected_counts = {"mlp": 1, "transformer": 2}  # per block per step, in forward and in backward
    for rank, out in enumerate(outputs):
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [r["block"] for r in records] == ["mlp", "transformer"]
        for r in records:
            label = f"rank {rank} {r['block']}"
            assert max(r["output"], r["input_grad"], r["param_grad"]) <= 1e-5, label
            assert r["forward_all_reduces"] == expected_counts[r["block"]], label
            assert r["backward_all_reduces"] == expected_counts[r["block"]], label


def _comm(size: int = 2) -> TensorParallelComm:
    return TensorParallelComm(None, 0, size)  # no group: layout and errors only, no collectives


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_auto_plan_recognises_gpt_blocks():
    plan = auto_plan(CharGPT(layers=2))
    assert plan == {
        "embed.tokens": "embedding",
        "embed.positions": "embedding",
        "blocks.0.attn": "attention",
        "blocks.0.mlp": "mlp",
        "blocks.1.attn": "attention",
        "blocks.1.mlp": "mlp",
    }
    with pytest.raises(ValueError, match="found no MLP, attention or embedding"):
        auto_plan(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_shards_keep_parameter_identity_and_halve_the_heads():
    block = Block(16, 4)
    before = [id(p) for p in block.parameters()]
    apply_tensor_parallel(block, "auto", _comm())
    assert [id(p) for p in block.parameters()] == before  # an optimizer built earlier still holds them
    assert block.attn.n_heads == 2
    assert block.attn.q_proj.weight.shape == (8, 16) and block.attn.out_proj.weight.shape == (16, 8)
    assert block.mlp[0].weight.shape == (32, 16) and block.mlp[2].weight.shape == (16, 32)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_bad_sizes_name_the_values():
    with pytest.raises(ValueError, match="cannot split the 3 attention heads of 'attn'"):
        apply_tensor_parallel(Block(18, 3), "auto", _comm())
    mlp = nn.Sequential(nn.Linear(8, 5), nn.GELU(), nn.Linear(5, 8))
    with pytest.raises(ValueError, match="size 2 cannot split the hidden size of '' .* of size 5"):
        apply_tensor_parallel(mlp, "auto", _comm())
    with pytest.raises(ValueError, match="'nope', which is not a module"):
        apply_tensor_parallel(nn.Sequential(nn.Linear(2, 2)), {"nope": "mlp"}, _comm())
    with pytest.raises(ValueError, match="size must be an int >= 1, got 0"):
        TensorParallelConfig(size=0)
    with pytest.raises(ValueError, match="cannot split the vocabulary"):
        apply_tensor_parallel(nn.Sequential(nn.Embedding(7, 4)), "auto", _comm())


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_single_shard_is_the_identity():
    torch.manual_seed(0)
    block = Block(16, 4)
    x = torch.randn(2, 3, 16)
    expected = block(x)
    apply_tensor_parallel(block, "auto", _comm(1))
    torch.testing.assert_close(block(x), expected, atol=0, rtol=0)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_auto_plan_splits_linear_activation_linear_pairs_of_a_sequential():
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Softmax(-1),
        nn.Linear(16, 4),
    )
    assert auto_plan(model) == {"": "mlp"}
    dims = apply_tensor_parallel(model, "auto", _comm())
    kinds = [type(m).__name__ for m in model]
    # (0, 2) is a pair; 4 and 6 are not (softmax mixes the hidden units), so they stay whole.
    assert kinds[:3] == ["ColumnParallelLinear", "Tanh", "RowParallelLinear"]
    assert kinds[4:] == ["Linear", "Softmax", "Linear"]
    assert model[0].weight.shape == (8, 8) and len(dims) == 3  # weight, bias of fc1; weight of fc2
