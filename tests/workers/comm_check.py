"""Every loom.comm all-reduce algorithm against native and a one-process reference; print one JSON line.

Run as N ranks. Inputs are seeded by (case, rank), so each rank can rebuild every rank's input and reduce them
locally: that is the reference. Output: {"failures": [...], "bytes": {algorithm: snapshot},
"group": {...} (N >= 3 only)}.

Run by tests/test_comm.py, tests/test_comm_shm.py.
"""

import itertools
import json

import torch
import torch.distributed as dist

import loom
from loom import comm
from loom.comm import ring
from loom.comm.links import ring_link
from loom.comm.ring import ring_schedule, run_ring

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
# Error bound relative to sum(|x_r|): summing N terms in another order moves the result by a few roundings.
TOLERANCE = {
    torch.float32: 1e-6,
    torch.float64: 1e-6,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
    torch.int64: 0,
}
BYTES_NUMEL = 60  # divisible by 2, 3 and 4, so the ring's chunks are equal

topo = loom.init()
rank, n = topo.rank, topo.world_size
failures: list[str] = []


def make_input(case: int, r: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + r)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def reference(inputs: list[torch.Tensor], op: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduction computed in float64 in one process, and the scale its rounding error is measured against."""
    stack = torch.stack([t.double() for t in inputs])
    scale = stack.abs().sum(0)
    if op == "sum":
        return stack.sum(0), scale
    if op == "avg":
        return stack.mean(0), scale / len(inputs)
    return (stack.amax(0) if op == "max" else stack.amin(0)), scale


def close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, tol: float) -> bool:
    return bool(((got.double() - want.double()).abs() <= tol * scale).all())


def check_case(case: int, dtype: torch.dtype, shape: tuple[int, ...], op: str, transpose: bool) -> None:
    inputs = [make_input(case, r, dtype, shape) for r in range(n)]
    want, scale = reference(inputs, op)
    tol = 0.0 if op in ("max", "min") else TOLERANCE[dtype]
    native = comm.all_reduce(inputs[rank].clone(), op, "native")
    for algorithm in comm.ALGORITHMS:
        mine = inputs[rank].clone()
        if transpose:  # a non-contiguous view of the same values
            mine = mine.t().contiguous().t()
        out = comm.all_reduce(mine, op, algorithm)
        label = f"rank {rank} {algorithm} {op} {dtype} {tuple(shape)}"
        if out is not mine:
            failures.append(f"{label}: did not return its input tensor")
        if out.dtype != dtype or out.shape != shape:
            failures.append(f"{label}: changed dtype or shape")
        elif not close(out, native, scale, tol):
            failures.append(f"{label}: differs from native by {(out.double() - native.double()).abs().max()}")
        elif not close(out, want, scale, tol):
            failures.append(f"{label}: differs from the reference by {(out.double() - want).abs().max()}")
        if algorithm == "ring":  # the same schedule over gloo's point-to-point calls: the same bits
            ring.TRANSPORT = "gloo"
            try:
                over_gloo = comm.all_reduce(inputs[rank].clone(), op, "ring")
            finally:
                ring.TRANSPORT = "links"
            if not torch.equal(over_gloo, out.contiguous()):
                failures.append(f"{label}: differs between loom's links and gloo's point-to-point calls")


def check_integer_avg_refused() -> None:
    for algorithm in comm.ALGORITHMS:
        try:
            comm.all_reduce(torch.ones(3, dtype=torch.int64), "avg", algorithm)
        except ValueError as error:
            if "int64" not in str(error):
                failures.append(
                    f"rank {rank} {algorithm}: avg-on-int64 error does not name the dtype: {error}"
                )
        else:
            failures.append(f"rank {rank} {algorithm}: avg on int64 did not raise")


def measure_bytes(group: dist.ProcessGroup | None = None) -> dict[str, dict]:
    result = {}
    for algorithm in comm.ALGORITHMS:
        comm.counters().reset()
        comm.all_reduce(torch.ones(BYTES_NUMEL, dtype=torch.float32), "sum", algorithm, group=group)
        result[algorithm] = comm.counters().snapshot()
    return result


def check_group(members: list[int]) -> dict:
    """all-reduce on a group that excludes global rank 0, so group ranks differ from global ranks."""
    group = dist.new_group(members)  # every rank must take part in creating it
    if rank not in members:
        return {}
    me = members.index(rank)
    for case, op in enumerate(("sum", "avg", "max"), start=10_000):
        inputs = [make_input(case, r, torch.float64, (7,)) for r in range(len(members))]
        want, scale = reference(inputs, op)
        for algorithm in comm.ALGORITHMS:
            got = comm.all_reduce(inputs[me].clone(), op, algorithm, group=group)
            if not close(got, want, scale, 1e-12):
                failures.append(f"rank {rank} group {members} {algorithm} {op}: differs from the reference")
    return {"group_rank": me, "size": len(members), "bytes": measure_bytes(group)}


def check_segmented_ring() -> None:
    """The pipelined ring over real gloo messages with tiny segments: many transfers per chunk and several in
    flight on one pair at once (the default segments are MiB, too large for the sizes above)."""
    for case, (numel, segment_bytes, window, op) in enumerate(
        itertools.product((1001, 3000), (200, 2000), (1, 3), ("avg", "max")), start=20_000
    ):
        inputs = [make_input(case, r, torch.float64, (numel,)) for r in range(n)]
        want, scale = reference(inputs, op)
        local_op, divide_by = ("sum", n) if op == "avg" else (op, 1)
        links = ring_link(None, tuple(range(n)), rank, inputs[rank])
        for transport, link in (("gloo", None), ("links", links)):
            flat = inputs[rank].clone()
            transfers, w = ring_schedule(flat, rank, n, segment_bytes=segment_bytes, window=window)
            right, left = (rank + 1) % n, (rank - 1) % n
            sent, received = run_ring(transfers, w, local_op, right, left, None, divide_by, link)
            label = f"rank {rank} segmented ring over {transport} {op} numel={numel} segment_bytes={segment_bytes} window={window}"
            if not close(flat, want, scale, 1e-12):
                failures.append(f"{label}: differs from the reference by {(flat - want).abs().max()}")
            exact = 2 * (n - 1) * flat.nbytes // n
            if numel % n == 0 and (sent, received) != (exact, exact):
                failures.append(f"{label}: sent {sent} received {received} bytes")


cases = itertools.product(DTYPES, sorted({0, 1, n - 1, 1000, 1001}), comm.OPS)
for case, (dtype, size, op) in enumerate(cases):
    if op == "avg" and not dtype.is_floating_point:
        continue  # refused, checked below
    check_case(case, dtype, (size,), op, transpose=False)
for case, dtype in enumerate(DTYPES, start=5_000):
    check_case(case, dtype, (3, 5), "sum", transpose=True)
check_integer_avg_refused()
check_segmented_ring()
group = check_group(list(range(1, n))) if n >= 3 else {}
link = ring_link(None, tuple(range(n)), rank, torch.zeros(1))
sockets = {"linked": link is not None, "rejected": link.rejected if link else None}
print(json.dumps({"failures": failures, "bytes": measure_bytes(), "group": group, "ring_sockets": sockets}))
