"""Healing side by side: torchft 0.2.0 and ``loom run --on-worker-failure heal``, one kill schedule, one report.

    python -m loom_bench.heal_compare --side torchft --side loom --replicas 3 --kills 1@20,2@60,0@100

Each side trains the same MLP (784-H-H-10, SGD, synthetic batches) on ``--replicas`` processes of this host. The
harness follows every worker's per-step records (`loom_bench.heal_records`) and, for each ``R@S`` of the schedule,
SIGKILLs replica R's process once that process has committed step S with every replica present, and not before
the previous kill's replacement has trained a step with its own gradients, plus ``--tail-steps`` (so a late
replacement delays the later kills instead of stacking them; the kill line records the step it came after). Once
the last replacement is back, the harness asks every worker to stop ``--tail-steps`` later. torchft's replacement is started by the harness at once (torchft
has no launcher); loom's by ``loom run`` itself. The report (``benchmarks/reports/heal_vs_torchft_<sides>.md``,
and the same as JSON) gives each kill's figures and their medians: (a) from the kill to the survivors' next
committed step, (b) from the replacement's process start to its first committed step (seconds, and steps after
its start), (c) the survivors' attempts that were not committed, and the stall in healthy steps; the load average
sampled at each kill; the command.

The loom side runs `loom_bench.heal_loom_worker` under ``loom run -n R --on-worker-failure heal``; until a loom with
that mode is installed, ``--side loom`` stops with the reason before starting anything. torchft runs from its own
virtual environment (`loom_bench.heal_torchft`); loom never imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from loom_bench.heal_records import STOP_FILE, append_kill, summarize
from loom_bench.heal_report import write_report
from loom_bench.heal_torchft import SRC, TorchftSettings, TorchftSide


class Side(Protocol):
    name: str

    def start(self) -> None: ...
    def replace(self, replica: int) -> None: ...
    def finished(self) -> bool: ...
    def failures(self) -> list[str]: ...
    def close(self) -> None: ...
    def describe(self) -> dict[str, object]: ...


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """``"1@20,2@60"`` -> ``[(1, 20), (2, 60)]`` (replica, step), checked to be in increasing step order."""
    kills: list[tuple[int, int]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        replica, sep, step = item.partition("@")
        if not sep or not replica.isdigit() or not step.isdigit():
            raise ValueError(f"--kills item {item!r}: write REPLICA@STEP, e.g. 1@20")
        kills.append((int(replica), int(step)))
    if [s for _, s in kills] != sorted({s for _, s in kills}):
        raise ValueError(f"--kills {text!r}: steps must increase strictly (one kill per step)")
    return kills


class RecordTail:
    """Reads the complete lines appended to the record files since the last call (the harness's live view)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}

    def new_records(self) -> list[dict[str, Any]]:
        records = []
        for path in self.directory.glob("replica*.jsonl"):
            with open(path, "rb") as source:
                source.seek(self._offsets.get(path, 0))
                chunk = source.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            records += [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
        return records


@dataclass
class KillLoop:
    """The schedule, run against the live records: which pid is each replica now, has it committed step S with
    every replica present, then SIGKILL it and let the side replace it."""

    side: Side
    records: Path
    replicas: int
    kills: list[tuple[int, int]]
    phase: str = "random"
    seed: int = 0
    loads: list[float] = field(default_factory=list)
    _current: dict[int, int] = field(default_factory=dict)  # replica -> its live pid
    _dead: set[int] = field(default_factory=set)
    _last_commit: dict[int, float] = field(default_factory=dict)  # pid -> time of its latest commit
    _step_time: dict[int, float] = field(default_factory=dict)  # pid -> its latest step's duration
    tail_steps: int = 10
    stopped_at: int | None = None
    _awaiting: int | None = None  # the replica whose replacement is not back yet
    _settled_from: int = 0  # no kill before this step: the last replacement's return plus tail_steps

    def run(self, deadline_s: float) -> None:
        tail, pending, end = RecordTail(self.records), list(self.kills), time.monotonic() + deadline_s
        while not self.side.finished():
            if self.side.failures():  # a dead worker the harness did not kill: stop now, not at the deadline
                raise RuntimeError(f"{self.side.name}: " + "; ".join(self.side.failures()))
            if time.monotonic() > end:
                raise TimeoutError(f"{self.side.name}: the run passed --deadline {deadline_s:.0f} s; records in "
                                   f"{self.records}. HINT: fewer steps, or a later kill")  # fmt: skip
            for record in sorted(tail.new_records(), key=lambda r: r["t"]):
                if record["kind"] == "start" and record["pid"] not in self._dead:
                    self._current[record["replica"]] = record["pid"]
                if record["kind"] == "step" and record["committed"]:
                    if record["pid"] in self._last_commit:
                        self._step_time[record["pid"]] = record["t"] - self._last_commit[record["pid"]]
                    self._last_commit[record["pid"]] = record["t"]
                if self._awaiting is not None and self._back_in_full(record, self._awaiting):
                    self._awaiting, self._settled_from = None, record["step"] + self.tail_steps
                if self._awaiting is not None:
                    continue
                if pending and self._due(record, *pending[0]):
                    self._awaiting = pending.pop(0)[0]
                    self._kill(self._awaiting, record["step"])
                elif not pending and self.stopped_at is None and record["kind"] == "step":
                    self._stop(record["step"] + self.tail_steps)  # ahead of every worker: all read it in time
            time.sleep(0.005)
        if self.side.failures():
            raise RuntimeError(f"{self.side.name}: " + "; ".join(self.side.failures()))
        if pending:
            raise RuntimeError(f"{self.side.name}: the run ended before the kills {pending} were due")

    def _due(self, record: dict[str, Any], replica: int, step: int) -> bool:
        return (
            record["kind"] == "step"
            and record["committed"]
            and record["pid"] == self._current.get(replica)
            and record["step"] >= max(step, self._settled_from)
            and record["participants"] in (self.replicas, None)
        )

    def _back_in_full(self, record: dict[str, Any], replica: int) -> bool:
        """``replica``'s replacement committed a step with its own gradients and every replica present: the
        next kill may come (``tail_steps`` later, so that each kill meets a settled job), or the run may end."""
        return (
            record["kind"] == "step"
            and record["committed"]
            and record["pid"] == self._current.get(replica)
            and record["pid"] not in self._dead  # the victim's own last line, read after the kill
            and record.get("participating", True)
            and record["participants"] in (self.replicas, None)
        )

    def _stop(self, step: int) -> None:
        """Tell every worker the step to stop after (`STOP_FILE`): they run in lockstep, so all stop at the same
        step, and none waits for a quorum that a finished peer will never join."""
        temporary = self.records / f"{STOP_FILE}.tmp"
        temporary.write_text(str(step))
        os.replace(temporary, self.records / STOP_FILE)
        self.stopped_at = step

    def _kill(self, replica: int, step: int) -> None:
        """SIGKILL ``replica``'s live process, which has just committed ``step`` (the scheduled one, or a later
        one when the schedule waited for full membership), at the chosen point of the victim's next step: ``phase`` (a fraction, or "random": a seeded
        uniform one per kill) times its latest step's duration after its due commit, so kills land in the
        quorum, the forward/backward or the exchange alike rather than always just after a commit."""
        pid = self._current[replica]
        fraction = self._fraction(len(self.loads))
        wait = fraction * self._step_time.get(pid, 0.0) - (
            time.time() - self._last_commit.get(pid, time.time())
        )
        if wait > 0:
            time.sleep(wait)
        self.loads.append(os.getloadavg()[0])
        t = time.time()
        append_kill(self.records, replica, pid, step, t, phase=fraction)
        os.kill(pid, signal.SIGKILL)
        self._dead.add(pid)
        self.side.replace(replica)

    def _fraction(self, index: int) -> float:
        if self.phase == "random":
            return random.Random(f"{self.seed}/{index}").random()  # the same fractions on both sides
        return float(self.phase)


@dataclass
class LoomSide:
    """``loom run -n R --on-worker-failure heal`` of `loom_bench.heal_loom_worker`; the launcher replaces."""

    records: Path
    replicas: int
    steps: int
    batch: int
    hidden: int
    max_heals: int
    mode: str = "heal"
    """``heal``; or ``stop``, loom's default, to check this plumbing without kills before heal exists"""
    loom_src: str | None = None
    """a loom source tree to run instead of this checkout's (e.g. an export of a branch not yet merged)"""
    name: str = "loom"
    _launcher: subprocess.Popen | None = None

    def _policy(self) -> list[str]:
        if self.mode == "heal":
            return ["--on-worker-failure", "heal", "--max-heals", str(self.max_heals)]
        return ["--on-worker-failure", self.mode]

    def describe(self) -> dict[str, object]:
        return {"side": self.name, "launcher": f"loom run -n {self.replicas} {' '.join(self._policy())}"}

    def start(self) -> None:
        if self.mode == "heal":
            check_loom_heal(self.loom_src)
        command = [sys.executable, "-m", "loom.cli", "run", "-n", str(self.replicas), *self._policy(),
                   "--run-dir", str(self.records / "run"), str(SRC / "loom_bench" / "heal_loom_worker.py"), "--records", str(self.records), "--steps",
                   str(self.steps), "--batch", str(self.batch), "--hidden", str(self.hidden)]  # fmt: skip
        log = open(self.records / "loom-run.log", "wb")  # noqa: SIM115 (the child holds it)
        env = loom_env(self.loom_src)
        self._launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True)  # fmt: skip

    def replace(self, replica: int) -> None:
        """Nothing: healing is the launcher's job on this side."""

    def finished(self) -> bool:
        return self._launcher is not None and self._launcher.poll() is not None

    def failures(self) -> list[str]:
        if self._launcher is None or self._launcher.returncode in (None, 0):
            return []
        return [f"loom run exited with {self._launcher.returncode}; see {self.records}/loom-run.log"]

    def close(self) -> None:
        if self._launcher is not None and self._launcher.poll() is None:
            os.killpg(self._launcher.pid, signal.SIGTERM)
            try:
                self._launcher.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self._launcher.pid, signal.SIGKILL)
                self._launcher.wait()


def loom_env(loom_src: str | None) -> dict[str, str]:
    """The environment the loom side runs in: ``loom_src`` (when given) before this checkout's src."""
    paths = [p for p in (loom_src, str(SRC), os.environ.get("PYTHONPATH")) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def check_loom_heal(loom_src: str | None = None) -> None:
    """Stop with the reason unless this loom's ``loom run`` accepts ``--on-worker-failure heal``.

    argparse checks ``heal`` against the choices before it reaches ``--help``: exit 0 means accepted."""
    probe = subprocess.run(
        [sys.executable, "-m", "loom.cli", "run", "--on-worker-failure", "heal", "--max-heals", "1", "--help"],
        capture_output=True, text=True, timeout=120, env=loom_env(loom_src),
    )  # fmt: skip
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise SystemExit(
            "heal_compare --side loom: this loom's `loom run` refuses `--on-worker-failure heal --max-heals 1` "
            f"({why}). The loom side needs the healing launcher (issue 23, branch heal). HINT: run --side torchft "
            "alone until it is merged"
        )


def run_side(side_name: str, ns: argparse.Namespace, records: Path) -> dict[str, Any]:
    """One run of one side on the schedule; returns its summary (the report's input)."""
    records.mkdir(parents=True)
    common = dict(records=records, replicas=ns.replicas, steps=ns.steps, batch=ns.batch, hidden=ns.hidden)
    side: Side
    if side_name == "torchft":
        settings = TorchftSettings(python=ns.torchft_python, min_replicas=ns.replicas - 1,
                                   heartbeat_timeout_ms=ns.heartbeat_timeout_ms, join_timeout_ms=ns.join_timeout_ms,
                                   ddp_hook=ns.torchft_ddp_hook, pg_timeout_s=ns.torchft_pg_timeout)  # fmt: skip
        side = TorchftSide(settings=settings, **common)  # type: ignore[arg-type]
    else:
        heals = ns.loom_max_heals if ns.loom_max_heals is not None else len(ns.schedule) + 3
        side = LoomSide(max_heals=max(1, heals), mode=ns.loom_mode, loom_src=ns.loom_src, **common)  # type: ignore[arg-type]
    loop = KillLoop(side, records, ns.replicas, ns.schedule, phase=ns.kill_phase, seed=ns.seed,
                    tail_steps=ns.tail_steps)  # fmt: skip
    load_before = os.getloadavg()[0]
    started = time.time()
    try:
        side.start()
        loop.run(ns.deadline)
    finally:
        side.close()
    if side.failures():
        raise RuntimeError(f"{side_name}: " + "; ".join(side.failures()))
    from loom_bench.heal_records import read_records

    summary = summarize(read_records(records), ns.replicas)
    summary.update(
        side=side.describe(), started=started, wall_s=time.time() - started, records=str(records),
        load={"before": load_before, "at_kills": loop.loads, "after": os.getloadavg()[0]},
    )  # fmt: skip
    return summary


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loom_bench.heal_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--side", action="append", choices=["torchft", "loom"], required=True,
                        help="a side to run (repeat for both; they run one after the other, in the order given)")  # fmt: skip
    parser.add_argument("--replicas", type=int, default=3, help="processes (replica groups of one process)")
    parser.add_argument("--kills", default="1@20,2@60,0@100", help="the schedule, REPLICA@STEP,...")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="most committed steps (default: last kill + 1000); a run ends "
        "--tail-steps after the last replacement trains at full membership",
    )
    parser.add_argument(
        "--tail-steps",
        type=int,
        default=10,
        help="steps between a replacement's return and the next kill, or the end",
    )
    parser.add_argument("--batch", type=int, default=32, help="samples per replica per step")
    parser.add_argument("--hidden", type=int, default=1024, help="the MLP's hidden width (784-H-H-10)")
    parser.add_argument("--kill-phase", default="random",
                        help="where in the victim's next step the kill lands, as a fraction of a step after the "
                        "due commit (0 = at once), or 'random' (seeded by --seed, the same on both sides)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the random kill phases")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds one side may run")
    parser.add_argument("--torchft-python", default=TorchftSettings.python, help="torchft's venv interpreter")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=TorchftSettings.heartbeat_timeout_ms,
                        help="torchft lighthouse: a replica silent this long is dead (torchft's default)")  # fmt: skip
    parser.add_argument("--join-timeout-ms", type=int, default=TorchftSettings.join_timeout_ms,
                        help="torchft lighthouse: how long a quorum waits for a straggler (torchft's default)")  # fmt: skip
    parser.add_argument("--torchft-pg-timeout", type=float, default=TorchftSettings.pg_timeout_s,
                        help="torchft: gloo's collective timeout, seconds (its train_ddp.py on CPU: 5)")  # fmt: skip
    parser.add_argument("--torchft-ddp-hook", choices=["completed", "original"], default="completed",
                        help="torchft's DDP hook with its error path completed (default), or as released")  # fmt: skip
    parser.add_argument(
        "--loom-src", default=None, help="run the loom side with this loom source tree (a src/)"
    )
    parser.add_argument("--loom-max-heals", type=int, default=None,
                        help="loom run --max-heals (default: the kills + 3, for members the launcher itself drops, "
                        "e.g. one that did not check in under load; its log names them)")  # fmt: skip
    parser.add_argument("--loom-mode", choices=["heal", "stop"], default="heal",
                        help="loom's --on-worker-failure; 'stop' checks the loom side's plumbing with --kills ''")  # fmt: skip
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="where the records go (default: a temp dir)"
    )
    parser.add_argument("--out", type=Path, default=None, help="the report (default: benchmarks/reports/...)")
    ns = parser.parse_args(argv)
    try:
        ns.schedule = parse_schedule(ns.kills)
        if ns.kill_phase != "random" and not 0 <= float(ns.kill_phase) < 1:
            raise ValueError(f"--kill-phase {ns.kill_phase}: a fraction in [0, 1), or 'random'")
    except ValueError as error:
        parser.error(str(error))
    if ns.loom_mode != "heal" and ns.schedule:
        parser.error(f"--loom-mode {ns.loom_mode} stops the job at the first kill: give --kills ''")
    if ns.replicas < 2:
        parser.error(f"--replicas {ns.replicas}: healing needs at least 2 (a survivor to heal from)")
    if any(r >= ns.replicas for r, _ in ns.schedule):
        parser.error(f"--kills {ns.kills}: replicas are 0..{ns.replicas - 1}")
    ns.steps = ns.steps or (ns.schedule[-1][1] + 1000 if ns.schedule else 1000)
    if ns.schedule and ns.steps <= ns.schedule[-1][1]:
        parser.error(f"--steps {ns.steps}: must exceed the last kill's step {ns.schedule[-1][1]}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_arguments(argv)
    if "loom" in ns.side and ns.loom_mode == "heal":
        check_loom_heal(ns.loom_src)  # before anything runs, not after the torchft side's minutes
    work = ns.work_dir or Path(tempfile.mkdtemp(prefix="heal_compare_"))
    results = {side: run_side(side, ns, work / side) for side in ns.side}
    out = ns.out or Path("benchmarks/reports") / f"heal_vs_torchft_{'_'.join(ns.side)}.md"
    command = "python -m loom_bench.heal_compare " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    write_report(out, results, command=command, settings=vars(ns))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
