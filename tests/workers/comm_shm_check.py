"""shm, hierarchical and auto beyond comm_check.py's matrix; print one JSON line.

Run as N ranks, with $LOOM_CACHE_DIR pointing at a test directory. Three groups, each with its own segment:

- the default group (one real host): exact shm bytes, segment growth, and the segment's name and whether it
  was already unlinked;
- ``pieces``: all ranks, with `loom.comm.shm.MAX_PIECE_BYTES` lowered so tensors go through in many pieces;
- ``fake``: all ranks, made after setting $LOOM_HOST_ID so that ranks pretend to be on 2 hosts
  (N=2: 1+1, N=3: 2+1, N=4: 2+2); the full correctness matrix runs there for hierarchical and auto, and
  shm must refuse the group.

Output: {"failures", "bytes": {...}, "segments": [names], "linked": [names still in /dev/shm], "policies"}.

Run by tests/test_comm_shm.py.
"""

import itertools
import json
import os

import torch
import torch.distributed as dist

import loom
from loom import comm
from loom.comm import auto, shm
from loom.comm.shm_segment import SHM_DIR

topo = loom.init()
rank, n = topo.rank, topo.world_size
auto.CALIBRATION_SIZES, auto.CALIBRATION_REPS = (4 << 10, 256 << 10), 3  # a short calibration for tests
failures: list[str] = []
NUMEL = 60  # divisible by 2, 3, 4

# The inputs, reference and tolerances of comm_check.py (a script: importing it would run it).
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
TOLERANCE = {
    torch.float32: 1e-6,
    torch.float64: 1e-6,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
    torch.int64: 0,
}


def make_input(case: int, r: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + r)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def reference(inputs: list[torch.Tensor], op: str) -> tuple[torch.Tensor, torch.Tensor]:
    stack = torch.stack([t.double() for t in inputs])
    scale = stack.abs().sum(0)
    if op == "sum":
        return stack.sum(0), scale
    if op == "avg":
        return stack.mean(0), scale / len(inputs)
    return (stack.amax(0) if op == "max" else stack.amin(0)), scale


def close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, tol: float) -> bool:
    return bool(((got.double() - want.double()).abs() <= tol * scale).all())


def check(case: int, dtype, size: int, op: str, algorithm: str, group, label: str) -> None:
    inputs = [make_input(case, r, dtype, (size,)) for r in range(n)]
    want, scale = reference(inputs, op)
    tol = 0.0 if op in ("max", "min") else TOLERANCE[dtype]
    native = comm.all_reduce(inputs[rank].clone(), op, "native", group=group)
    got = comm.all_reduce(inputs[rank].clone(), op, algorithm, group=group)
    where = f"rank {rank} {label} {algorithm} {op} {dtype} ({size},)"
    if got.dtype != dtype or not close(got, native, scale, tol) or not close(got, want, scale, tol):
        failures.append(f"{where}: differs from native or the reference")


def traffic(algorithm: str, group=None, numel: int = NUMEL) -> dict:
    comm.counters().reset()
    comm.all_reduce(torch.ones(numel), "sum", algorithm, group=group)
    return {**comm.counters().snapshot(), **comm.counters().by_transport()}


def segment_of(group) -> list[str]:
    segment = shm.context_for(group).segment
    return [segment.name] if segment is not None else []


# The default group, one real host: bytes after set-up, then growth through larger and larger tensors.
for algorithm in ("shm", "auto"):  # set up the segment, calibrate
    comm.all_reduce(torch.ones(NUMEL), "sum", algorithm)
result = {"bytes": {a: traffic(a) for a in ("shm", "hierarchical", "auto")}}
result["auto_choice"] = auto.choose_algorithm(NUMEL * 4, None, {})
segments = segment_of(None)
capacity = shm.context_for(None).capacity
for case, size in enumerate((10, 5_000, 40_000, 300_001), start=20_000):
    check(case, torch.float32, size, "sum", "shm", None, "growth")
segments += segment_of(None)
result["grew"] = shm.context_for(None).capacity > capacity  # then it has a new segment, under a new name

# Many pieces: a slot of 256 bytes holds 64 float32 or 32 int64 values.
pieces = dist.new_group(list(range(n)))
shm.MAX_PIECE_BYTES = 256
for case, (dtype, size, op) in enumerate(
    itertools.product(DTYPES, (1, 63, 65, 1001), ("sum", "max")), start=30_000
):
    for algorithm in ("shm", "hierarchical"):
        check(case, dtype, size, op, algorithm, pieces, "pieces")
check(31_000, torch.float64, 777, "avg", "shm", pieces, "pieces")
segments += segment_of(pieces)
shm.MAX_PIECE_BYTES = 4 << 20

# Pretend to be on two hosts.
os.environ["LOOM_HOST_ID"] = f"fake-host-{rank * 2 // n}"
fake = dist.new_group(list(range(n)))
try:
    comm.all_reduce(torch.ones(3), "sum", "shm", group=fake)
    failures.append(f"rank {rank}: shm accepted a group on two hosts")
except ValueError as error:
    if "2 hosts" not in str(error) or "HINT" not in str(error):
        failures.append(f"rank {rank}: unclear error for shm across hosts: {error}")
cases = itertools.product(DTYPES, sorted({0, 1, n - 1, 1000, 1001}), comm.OPS)
for case, (dtype, size, op) in enumerate(cases):
    if op == "avg" and not dtype.is_floating_point:
        continue
    for algorithm in ("hierarchical", "auto"):
        check(case, dtype, size, op, algorithm, fake, "fake-hosts")
result["bytes"]["fake_hierarchical"] = traffic("hierarchical", fake)
segments += segment_of(fake)

result["policies"] = {
    name: repr(auto._POLICIES[key]) for name, key in (("one_host", dist.group.WORLD), ("fake", fake))
}
result["auto_choices"] = [auto.choose_algorithm(1 << k, fake, {}) for k in range(10, 27)]
result.update(
    failures=failures,
    segments=segments,
    linked=[s for s in segments if (SHM_DIR / s).exists()],
    local_rank_fake=shm.context_for(fake).local_rank,
)
print(json.dumps(result))
