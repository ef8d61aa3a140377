"""``python -m loom_bench.kill_soak``: random kills over a DataParallel run that heals, against one process.

The issue's soak: "100 random kills over a DataParallel run on 3 processes, final parameters equal to one
process". The job is `loom_bench.kill_soak_worker` under ``loom run -n 3 --on-worker-failure heal --max-heals K``
(K = the kills, plus one spare). The driver reads the lines the workers print (``soak rank R pid P step S``,
forwarded by the launcher) to know each rank's live process, and then, ``--kills`` times: waits until every rank
has a process that has trained since the previous kill (the replacement trains), waits a random 0 to
``--max-delay-s`` seconds more (so a kill lands in a random phase of a step: data, forward, backward, the exchange,
the update), and SIGKILLs the process of a random rank. Once every rank trained again after the last kill, the
driver names the job's last step (300 steps ahead, `kill_soak_worker`'s ``--stop-file``), and the one-process
reference then runs as many steps.

Checked at the end: the launcher exited 0; every rank wrote its parameters; they are bitwise equal to each other
and within ``--tolerance`` (1e-5) of the same script run as one process on the same global batches. Figures: kills,
wall time, the time from each kill until every rank trained again (median and max), steps run.

Resources (issue 37: "no resource grows with heals"): before each kill the driver reads ``/proc`` of the launcher,
its zygote and every live worker (open descriptors, threads, resident memory; `Usage`), and reports, for the
launcher, the zygote and the worker process that lived through the most heals, the first and the last reading
with the heals between them. Descriptors and threads must not grow (``--resources-flat``: a check); memory is
reported (it moves with the allocator, not only with leaks).

Writes ``kill_soak.md`` and ``.json`` into ``--report-dir`` (default benchmarks/reports). Exit status 1 when a
check fails, 2 when the launcher refuses ``heal``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from safetensors.torch import load_file

_STOP_AHEAD = 300
"""Steps between the last step seen and the last step of the job, written after the last kill (`kill_soak_worker`'s
``--stop-file``): far more than the ~10 steps a printed step may lag and the steps run while every rank reads it."""
_LINE = re.compile(r"soak rank (?P<rank>\d+) pid (?P<pid>\d+) step (?P<step>\d+)")


@dataclass
class Live:
    """What the workers' lines said so far: each rank's newest process and step, under a lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    pid: dict[int, int] = field(default_factory=dict)
    step: dict[int, int] = field(default_factory=dict)
    seen_at: dict[int, float] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def read(self, stream, log: TextIO | None = None) -> None:
        for line in iter(stream.readline, ""):
            if log is not None:
                log.write(line)
            with self.lock:
                self.lines.append(line)
                if len(self.lines) > 400:
                    del self.lines[:200]
                match = _LINE.search(line)
                if match:
                    rank = int(match["rank"])
                    self.pid[rank], self.step[rank] = int(match["pid"]), int(match["step"])
                    self.seen_at[rank] = time.monotonic()

    def all_trained_since(self, moment: float, ranks: int) -> bool:
        with self.lock:
            return all(self.seen_at.get(r, -1.0) > moment for r in range(ranks))


@dataclass
class Usage:
    """What ``/proc`` says of one process at one moment, and the heals the job had made then."""

    heals: int
    fds: int
    threads: int
    rss_mib: float

    @classmethod
    def of(cls, pid: int, heals: int) -> Usage | None:
        try:
            with open(f"/proc/{pid}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, ValueError):
            return None  # gone meanwhile
        return cls(heals, fds, int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


@dataclass
class Watched:
    """The first and last `Usage` of each process watched, by role: ``launcher``, ``zygote``, ``worker PID``."""

    first: dict[str, Usage] = field(default_factory=dict)
    last: dict[str, Usage] = field(default_factory=dict)

    def sample(self, launcher: int, workers: list[int], heals: int) -> None:
        roles = {"launcher": launcher, **{f"worker {w}": w for w in workers}}
        zygotes = [
            c for c in _children(launcher) if c not in workers
        ]  # (its forked workers are the zygote's)
        if zygotes:
            roles["zygote"] = zygotes[0]
        for role, pid in roles.items():
            usage = Usage.of(pid, heals)
            if usage is not None:
                self.first.setdefault(role, usage)
                self.last[role] = usage

    def summary(self) -> dict[str, dict]:
        """The launcher, the zygote and the worker that lived through the most heals: first and last readings."""
        workers = [r for r in self.last if r.startswith("worker")]
        oldest = max(workers, key=lambda r: self.last[r].heals - self.first[r].heals, default=None)
        roles = ["launcher", "zygote"] + ([oldest] if oldest else [])
        return {
            r: {"first": vars(self.first[r]), "last": vars(self.last[r])} for r in roles if r in self.last
        }


def flat(summary: dict[str, dict]) -> bool:
    """Descriptors and threads of every process summarized did not grow between its first and last reading."""
    return all(s["last"]["fds"] <= s["first"]["fds"] and s["last"]["threads"] <= s["first"]["threads"]
               for s in summary.values())  # fmt: skip


def _launch(out: Path, steps: int, sleep_ms: float, nproc: int, heals: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "loom.cli", "run", "-n", str(nproc), "--run-dir", str(out / "run"),
        "--on-worker-failure", "heal",
        "--max-heals", str(heals), "-m", "loom_bench.kill_soak_worker", str(out), str(steps),
        "--sleep-ms", str(sleep_ms), "--stop-file", str(out / "stop_at"),
    ]  # fmt: skip
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _reference(out: Path, steps: int) -> dict[str, torch.Tensor]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOOM_", "MASTER_"))
    }
    subprocess.run(
        [sys.executable, "-m", "loom_bench.kill_soak_worker", str(out), str(steps)], env=env, check=True,
        timeout=600, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return load_file(str(out / "final_single.safetensors"))


def soak(args: argparse.Namespace, out: Path) -> dict:
    rng = random.Random(args.seed)
    live = Live()
    started = time.monotonic()
    proc = _launch(out, args.steps, args.sleep_ms, args.nproc, args.kills + 1)
    log = open(out / "launcher.log", "w")  # noqa: SIM115 (closed after the reader below ends)
    reader = threading.Thread(target=live.read, args=(proc.stdout, log), daemon=True)
    reader.start()
    recoveries: list[float] = []
    kills: list[dict] = []
    watched = Watched()
    error = None
    try:
        moment = started
        for k in range(args.kills):
            error = _wait_all_trained(live, proc, moment, args, k)
            if error:
                break
            if k:
                recoveries.append(time.monotonic() - moment)
            time.sleep(rng.uniform(0.0, args.max_delay_s))
            rank = rng.choice([r for r in range(args.nproc) if r != args.survivor])
            with live.lock:
                pid, step = live.pid[rank], live.step[rank]
                workers = list(live.pid.values())
            watched.sample(proc.pid, workers, k)
            moment = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            kills.append(
                {"rank": rank, "pid": pid, "last_step_seen": step, "at_s": round(moment - started, 3)}
            )
            print(f"kill {k + 1}/{args.kills}: rank {rank} (pid {pid}, near step {step})", flush=True)
        if error is None:
            error = _wait_all_trained(live, proc, moment, args, len(kills))
        if error is None:
            recoveries.append(time.monotonic() - moment)
            with live.lock:
                last = max(live.step.values()) + _STOP_AHEAD
            (out / "stop_at.partial").write_text(str(last))
            (out / "stop_at.partial").rename(out / "stop_at")
            proc.wait(timeout=args.recover_timeout_s + _STOP_AHEAD * (args.sleep_ms / 1000 + 0.5))
    except subprocess.TimeoutExpired:
        error = "the job did not end in time after the last kill"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=5)
        log.close()
    return {"exit": proc.returncode, "error": error, "kills": kills, "recoveries_s": recoveries,
            "wall_s": time.monotonic() - started, "tail": live.lines[-30:],
            "resources": watched.summary()}  # fmt: skip


def _wait_all_trained(
    live: Live, proc: subprocess.Popen, moment: float, args: argparse.Namespace, k: int
) -> str | None:
    """Wait until every rank trained after ``moment``; what went wrong instead (None: they all did)."""
    deadline = time.monotonic() + args.recover_timeout_s
    while not live.all_trained_since(moment, args.nproc):
        if proc.poll() is not None:
            return f"the job ended (exit {proc.returncode}) before kill {k + 1}"
        if time.monotonic() > deadline:
            return f"not every rank trained within {args.recover_timeout_s} s after kill {k}"
        time.sleep(0.02)
    return None


def _compare(out: Path, nproc: int, reference: dict[str, torch.Tensor]) -> dict:
    finals = [load_file(str(out / f"final_rank{r}.safetensors")) for r in range(nproc)]
    equal = all(torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in reference)
    diff = max(float((finals[0][k] - reference[k]).abs().max()) for k in reference)
    return {"ranks_bitwise_equal": equal, "max_abs_diff_vs_one_process": diff}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument(
        "--steps", type=int, default=100000, help="at most (the job ends after the last kill)"
    )
    parser.add_argument("--sleep-ms", type=float, default=20.0)
    parser.add_argument("--max-delay-s", type=float, default=1.0)
    parser.add_argument("--recover-timeout-s", type=float, default=120.0)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--survivor", type=int, default=None,
                        help="a rank never killed: its one process lives through every heal (resources)")  # fmt: skip
    parser.add_argument("--resources-flat", action=argparse.BooleanOptionalAction, default=True,
                        help="fail when a watched process's descriptors or threads grew (default: on)")  # fmt: skip
    parser.add_argument("--report-dir", type=Path, default=Path("benchmarks/reports"))
    args = parser.parse_args(argv)
    if args.survivor is not None and not (0 <= args.survivor < args.nproc and args.nproc > 1):
        parser.error(
            f"--survivor {args.survivor}: a rank of the job (0..{args.nproc - 1}) with another to kill"
        )
    load = os.getloadavg()[0]
    out = Path(tempfile.mkdtemp(prefix="loom-soak-"))
    result = soak(args, out)
    if result["exit"] == 2 and any("heal" in line for line in result["tail"]):
        print("".join(result["tail"]), file=sys.stderr)
        print("kill_soak: loom run refused --on-worker-failure heal", file=sys.stderr)
        return 2
    if result["exit"] == 0 and result["error"] is None:
        result["steps_run"] = int((out / "stop_at").read_text())
        result.update(_compare(out, args.nproc, _reference(out, result["steps_run"])))
    ok = _passed(result, args)
    if ok:
        shutil.rmtree(out, ignore_errors=True)
    else:
        print(f"kill_soak: kept {out} (launcher.log: every line the job printed; run/logs: each rank's)")
    result.update(
        ok=ok, load_before=load, load_after=os.getloadavg()[0], args=vars(args) | {"report_dir": None}
    )
    _write(args.report_dir, result)
    if not ok:
        print("".join(result["tail"]), file=sys.stderr)
    return 0 if ok else 1


def _passed(result: dict, args: argparse.Namespace) -> bool:
    return (
        result["exit"] == 0
        and result["error"] is None
        and result.get("ranks_bitwise_equal") is True
        and result["max_abs_diff_vs_one_process"] <= args.tolerance
        and len(result["kills"]) == args.kills
        and (flat(result["resources"]) or not args.resources_flat)
    )


def _write(report_dir: Path, result: dict) -> None:
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "kill_soak.json").write_text(
        json.dumps({k: v for k, v in result.items() if k != "tail"}, indent=1)
    )
    a, rec = result["args"], result["recoveries_s"]
    lines = [
        "# Kill soak: random kills over a DataParallel run that heals, against one process",
        "",
        f"Command: `python -m loom_bench.kill_soak --kills {a['kills']} --nproc {a['nproc']} --steps {a['steps']} "
        f"--sleep-ms {a['sleep_ms']} --max-delay-s {a['max_delay_s']} --seed {a['seed']}"
        f"{'' if a.get('survivor') is None else ' --survivor ' + str(a['survivor'])}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {result['load_before']:.1f} -> "
        f"{result['load_after']:.1f}).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| kills (SIGKILL, random rank, random moment) | {len(result['kills'])} |",
        f"| launcher exit status | {result['exit']} |",
        f"| error | {result['error'] or '-'} |",
        f"| final parameters bitwise equal on every rank | {result.get('ranks_bitwise_equal')} |",
        f"| max abs difference from one process | {result.get('max_abs_diff_vs_one_process')} |",
        f"| kill -> every rank trained again, median / max s | "
        f"{statistics.median(rec):.2f} / {max(rec):.2f} |"
        if rec
        else "| kill -> every rank trained again | - |",
        f"| steps run (the one-process reference ran as many) | {result.get('steps_run', '-')} |",
        f"| wall time s | {result['wall_s']:.1f} |",
        f"| verdict | {'pass' if result['ok'] else 'FAIL'} |",
        "",
        "Resources before the first and the last kill (`/proc`: descriptors, threads, resident MiB), for the launcher, "
        "its zygote and the worker process that lived through the most heals:",
        "",
        "| process | heals made then | descriptors | threads | resident MiB |",
        "|---|---|---|---|---|",
        *(
            f"| {role} | {u['first']['heals']} -> {u['last']['heals']} | {u['first']['fds']} -> {u['last']['fds']} | "
            f"{u['first']['threads']} -> {u['last']['threads']} | {u['first']['rss_mib']:.0f} -> "
            f"{u['last']['rss_mib']:.0f} |"
            for role, u in result.get("resources", {}).items()
        ),
    ]
    (report_dir / "kill_soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
