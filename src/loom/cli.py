"""The ``loom`` command: ``run`` (launch a job), ``demo`` (the built-in example), ``bench`` (measurements),
``report`` (a run's report), ``export`` (a checkpoint's whole model as safetensors), ``plan`` (which strategy:
predicted step time and memory, `loom.plan`)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from loom.launch.bounds import check_nproc, refuse
from loom.settings import SETTINGS, check_environment, setting

__all__ = ["main"]


def _number(convert: Callable[[str], Any], accept: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: ``convert(text)``, refused as not ``what`` unless ``accept`` says yes (NaN never does)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = _number(float, lambda v: v > 0, "a number of seconds > 0")
_trace_window = _number(SETTINGS["LOOM_TRACE_STEPS"].parse, bool, "FIRST:LAST steps with 1 <= FIRST <= LAST")


class _Parser(argparse.ArgumentParser):
    """A parse error is one line naming the value and where the options are listed, exit 2 (no usage dump);
    every subcommand's parser is one of these (``add_subparsers`` makes its parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def _default_run_dir() -> Path:
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def _add_run_parser(sub) -> None:
    p = sub.add_parser(
        "run",
        help="launch a training script on N local worker processes",
        description="Launch SCRIPT on N worker processes; each line is prefixed with "
        "its rank. Multi-node: run the same command on every node with --nnodes, --node-rank and --master.",
    )
    p.add_argument("-n", "--nproc", type=_positive_int, default=1, help="worker processes on this node")
    p.add_argument(
        "--max-nproc",
        type=_positive_int,
        default=None,
        metavar="N",
        help="most worker processes a host may start (default: 8 per core of the host); -n above it (or a "
        "cluster spec's nproc) is refused before anything starts",
    )
    p.add_argument("--max-restarts", type=_non_negative_int, default=0, help="restarts of the worker group")
    p.add_argument(
        "--on-worker-failure",
        choices=["stop", "continue", "heal"],
        default="stop",
        help="stop (default): a dead worker stops all workers (the group restarts up to --max-restarts times) "
        "and the job fails naming its rank. continue: the other workers go on (asynchronous parameter-server "
        "training; one node, no restarts); a line names each dead rank and its signal, and the exit status is 0 "
        "only if every other worker succeeded and the lost ones were killed by a signal. heal: the others go on "
        "in the same processes and a replacement for the lost rank copies a live peer's state and joins at a step "
        "boundary (DataParallel; one node or several: --nnodes, --cluster; up to --max-heals replacements in all)",
    )
    p.add_argument("--max-heals", type=_non_negative_int, default=3,
                   help="--on-worker-failure heal: replacements started in all; one more loss stops the job")  # fmt: skip
    p.add_argument("--min-workers", type=_positive_int, default=1,
                   help="--on-worker-failure heal: members below which the job stops, naming the lost ranks")  # fmt: skip
    p.add_argument("--nnodes", type=_positive_int, default=1, help="number of nodes in the job")
    p.add_argument("--node-rank", type=_non_negative_int, default=0, help="this node's rank, 0..nnodes-1")
    p.add_argument("--master", default=None, metavar="ADDR:PORT", help="node 0's rendezvous address")
    p.add_argument("--local-addr", default=None, help="the address other nodes reach this node at")
    p.add_argument("--join-timeout", type=_positive_float, default=120.0, metavar="SECONDS",
                   help="how long a node waits for the master and for every node to join (default 120)")  # fmt: skip
    p.add_argument(
        "--insecure-no-secret",
        action="store_true",
        help="let a multi-node job run without LOOM_JOB_SECRET (anyone who reaches the master can join it)",
    )
    p.add_argument("--run-dir", type=Path, default=None, help="logs and metrics (default: runs/<timestamp>)")
    p.add_argument("--servers", type=_non_negative_int, default=0, help="parameter-server processes to start")
    p.add_argument("--server-bind", default="127.0.0.1", help="address the parameter servers listen on")
    p.add_argument(
        "--max-server-restarts",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="restarts of each parameter server that dies while the job runs, on its address and from its "
        "checkpoint (default 3); one more death stops the job, naming the server and its signal",
    )
    p.add_argument("--trace-steps", type=_trace_window, default=None, metavar="A:B",
                   help="write a Chrome-trace timeline of steps A to B into the run directory")  # fmt: skip
    p.add_argument(
        "--cluster",
        default=setting("LOOM_CLUSTER") or None,
        metavar="SPEC",
        help="a JSON cluster spec (hosts, roles, nproc, server ports; default $LOOM_CLUSTER, a path or the JSON): "
        "every host runs the same command; replaces -n, --nnodes, --node-rank, --master, --local-addr, --servers",
    )
    p.add_argument(
        "--host-index",
        type=_non_negative_int,
        default=None,
        metavar="K",
        help="this host's position in the spec's hosts (default $LOOM_HOST_INDEX, else the host whose address "
        "is on this machine)",
    )
    p.add_argument(
        "--backend",
        choices=["local", "ray"],
        default="local",
        help="local (default): this host's processes; ray: one Ray actor per worker "
        "in a placement group (pip install 'loom-train[ray]'; see loom.ray)",
    )
    p.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="--backend ray: the Ray cluster (auto, or the GCS HOST:PORT); default: a local Ray instance for the "
        "job, stopped after it",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default=None,
        help="where workers train (default $LOOM_DEVICE, else auto: cuda:LOCAL_RANK on a host with GPUs, else the CPU); handed to "
        "the workers as LOOM_DEVICE; loom.init(device=...) in the script overrides it",
    )
    p.add_argument(
        "--share-gpus",
        action="store_true",
        help="let more workers than GPUs share them (local rank r on GPU r mod G, collectives over gloo); "
        "without it, -n above the host's GPU count is refused",
    )
    p.add_argument("-m", "--module", action="store_true", help="treat SCRIPT as a module name (python -m)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def _cmd_run(ns: argparse.Namespace) -> int:
    from loom.devices import check_gpu_count
    from loom.launch.agent import launch
    from loom.launch.spec import LaunchSpec

    # every LOOM_* setting, as the workers will read it (loom.settings)
    errors, warnings = check_environment()
    for line in warnings:
        print(f"loom run: warning: {line}", file=sys.stderr)
    if errors:
        return refuse("\n".join(f"loom run: {line}" for line in errors))
    if ns.device is not None:  # else the workers read LOOM_DEVICE as the launcher found it (checked already)
        os.environ["LOOM_DEVICE"] = ns.device
    if ns.share_gpus:
        os.environ["LOOM_SHARE_GPUS"] = "1"
    elsewhere = ns.backend == "ray" or ns.cluster or ns.host_index is not None  # not -n workers here
    try:  # more workers on this host than its GPUs, refused before anything starts
        if not elsewhere:
            check_gpu_count(ns.nproc, ns.device)
    except ValueError as error:
        return refuse(f"loom run: {error}")
    if ns.max_server_restarts is not None and elsewhere:
        return refuse("loom run: --max-server-restarts applies to the parameter servers of a one-node `loom run "
                        "--servers K`; the servers of --backend ray and of --cluster hosts are not restarted yet. "
                        "HINT: drop the option")  # fmt: skip
    if ns.backend == "ray":
        from loom.ray import run_from_cli  # here: ray is an optional extra, imported only on this path

        return run_from_cli(ns, ns.run_dir or _default_run_dir())
    if ns.address is not None:
        return refuse("loom run: --address is the Ray cluster's address. HINT: add --backend ray")
    if ns.cluster is not None or ns.host_index is not None:
        return _cmd_run_cluster(ns)

    try:
        spec = LaunchSpec(
            **_spec_options(ns), nproc=ns.nproc, nnodes=ns.nnodes, node_rank=ns.node_rank, master=ns.master,
            local_addr=ns.local_addr, servers=ns.servers, server_bind=ns.server_bind,
            max_server_restarts=3 if ns.max_server_restarts is None else ns.max_server_restarts,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as error:
        return refuse(f"loom run: {error}")
    return launch(spec)


def _cmd_run_cluster(ns: argparse.Namespace) -> int:
    """``--cluster``: the spec sets the hosts, nodes and servers (`loom.launch.cluster`)."""
    from loom.launch.cluster import ClusterSpecError, load_cluster, pick_host, run_host

    given = [flag for flag, value, default in (("-n", ns.nproc, 1), ("--nnodes", ns.nnodes, 1),
             ("--node-rank", ns.node_rank, 0), ("--master", ns.master, None), ("--local-addr", ns.local_addr, None),
             ("--servers", ns.servers, 0)) if value != default]  # fmt: skip
    try:
        if ns.cluster is None:
            raise ClusterSpecError("--host-index needs a cluster spec: --cluster SPEC or LOOM_CLUSTER")
        if given:
            raise ClusterSpecError(f"{', '.join(given)} cannot be combined with --cluster, whose spec sets them. "
                                   "HINT: drop them, or edit the spec")  # fmt: skip
        spec = load_cluster(ns.cluster)
        index = pick_host(spec, ns.host_index)
    except ClusterSpecError as error:
        return refuse(f"loom run: {error}")
    return run_host(spec, index, _spec_options(ns))


def _spec_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The `loom.launch.spec.LaunchSpec` fields a cluster spec leaves to the command line (`_cmd_run_cluster`);
    one node's launch adds the rest (`_cmd_run`)."""
    return dict(target=ns.script, args=tuple(ns.args), module=ns.module, max_restarts=ns.max_restarts,
                on_worker_failure=ns.on_worker_failure, run_dir=ns.run_dir or _default_run_dir(),
                trace_steps=ns.trace_steps, join_timeout_s=ns.join_timeout, insecure_no_secret=ns.insecure_no_secret,
                max_nproc=ns.max_nproc, max_heals=ns.max_heals, min_workers=ns.min_workers)  # fmt: skip


def _cmd_demo(ns: argparse.Namespace) -> int:
    from loom.demo.main import run_demo

    try:
        check_nproc(ns.nproc, None, override="the demo runs on this host only")
    except ValueError as error:
        return refuse(f"loom demo: {error}")
    return run_demo(nproc=ns.nproc, epochs=ns.epochs, run_dir=ns.run_dir or _default_run_dir())


def _cmd_bench(ns: argparse.Namespace) -> int:
    if ns.which == "dp":
        dp = _benchmark("data_parallel")
        return dp.run_benchmark(repetitions=ns.repetitions, steps=ns.steps, out_dir=ns.out, nproc=ns.nproc or 2,
                                model=ns.model or "1.9m")  # fmt: skip
    if ns.which == "allreduce":
        if ns.model is not None:
            return refuse("loom bench allreduce: --model applies to `loom bench dp` only. HINT: leave it out")
        sizes = {"world_sizes": (ns.nproc,)} if ns.nproc is not None else {}
        return _benchmark("allreduce").run_allreduce_benchmark(out_dir=ns.out, quick=ns.quick, **sizes)
    if ns.nproc is not None or ns.model is not None:
        return refuse(f"loom bench {ns.which}: -n/--nproc and --model apply to `loom bench dp` (and -n to "
                        "allreduce) only. HINT: leave them out")  # fmt: skip
    if ns.which == "links":
        return _benchmark("links").run_links_benchmark(out_dir=ns.out, reps=ns.repetitions, quick=ns.quick)
    if ns.which == "sharded":
        return _benchmark("sharded").run_sharded_benchmark(
            repetitions=ns.repetitions, steps=ns.steps, out_dir=ns.out
        )
    return _benchmark("checkpoint_overhead").run_checkpoint_benchmark(out_dir=ns.out)


def _benchmark(name: str) -> Any:
    """The benchmark module ``loom_bench.<name>``, looked up when ``loom bench`` runs: the benchmarks live beside
    the library in its repository (``src/loom_bench``), not in its wheel, and the library imports none of them."""
    try:
        return importlib.import_module(f"loom_bench.{name}")
    except ModuleNotFoundError as error:
        if error.name not in ("loom_bench", f"loom_bench.{name}"):
            raise
        raise SystemExit(
            "loom bench: the benchmarks (loom_bench) are not installed: they ship with loom's repository, not its "
            "wheel. HINT: run from a checkout (pip install -e .), or python -m loom_bench.<name> there."
        ) from None


def _cmd_report(ns: argparse.Namespace) -> int:
    if not ns.run_dir.is_dir():
        return refuse(f"loom report: run directory {str(ns.run_dir)!r} does not exist")
    from loom.observe.report import run_report

    return run_report(ns.run_dir)


def _cmd_export(ns: argparse.Namespace) -> int:
    from loom.checkpoint import CheckpointError
    from loom.checkpoint.export import export_model

    try:
        step, count = export_model(ns.checkpoint, ns.out)
    except (CheckpointError, OSError, ValueError) as err:
        return refuse(f"loom export: {err}")
    print(f"loom export: step {step}, {count} tensors -> {ns.out}")
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loom", description="Distributed training of PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_parser(sub)

    demo = sub.add_parser("demo", help="train a small CNN on the bundled digits data across local workers")
    demo.add_argument("-n", "--nproc", type=_positive_int, default=2, help="worker processes (default 2)")
    demo.add_argument("--epochs", type=_positive_int, default=8, help="training epochs (default 8)")
    demo.add_argument(
        "--run-dir", type=Path, default=None, help="logs and metrics (default: runs/<timestamp>)"
    )

    bench = sub.add_parser("bench", help="benchmarks against named baselines, measured in the same run")
    bench.add_argument(
        "which",
        choices=["dp", "allreduce", "checkpoint", "links", "sharded"],
        help="dp: DataParallel vs raw DDP; allreduce: algorithms vs native; checkpoint: save overhead; "
        "links: all-reduce and compressed DataParallel between network-namespace hosts on tc-limited links "
        "(needs root); sharded: ZeRO memory per rank and throughput vs raw FSDP2 and DataParallel",
    )
    bench.add_argument(
        "-n",
        "--nproc",
        type=_positive_int,
        default=None,
        help="dp: worker processes (default 2); allreduce: this N only (default 2 and 4)",
    )
    bench.add_argument(
        "--model",
        choices=["1.9m", "25m", "100m"],
        default=None,
        help="dp: the MLP's size in parameters (default 1.9m)",
    )
    bench.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (allreduce, links)")
    bench.add_argument("--repetitions", type=_positive_int, default=5, help="repetitions (median reported)")
    bench.add_argument("--steps", type=_positive_int, default=30, help="timed steps per repetition")
    bench.add_argument("--out", type=Path, default=Path("benchmarks/reports"), help="report directory")

    report = sub.add_parser("report", help="an HTML report with plots from a run directory")
    report.add_argument("run_dir", type=Path, help="the --run-dir of a finished (or running) job")

    export = sub.add_parser("export", help="the whole model of a checkpoint (sharded or not) as safetensors")
    export.add_argument("checkpoint", type=Path, help="a loom.fit checkpoint_dir (its newest) or one step-N")
    export.add_argument("out", type=Path, help="the .safetensors file to write")

    from loom.plan.command import add_plan_parser  # argparse and re only: no torch at parse time

    add_plan_parser(sub, _positive_int)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = _build_parser().parse_args(argv)
    from loom.plan.command import run_plan  # imported already, by _build_parser

    handlers = {"run": _cmd_run, "demo": _cmd_demo, "bench": _cmd_bench, "report": _cmd_report,
                "export": _cmd_export, "plan": run_plan}  # fmt: skip
    return handlers[ns.command](ns)


def console() -> None:
    """The ``loom`` command: `main`, then an exit without freeing torch object by object; atexit handlers still
    run and every open file is flushed (`loom.launch.worker.finish`). An exception takes the usual way out."""
    from loom.launch.worker import finish

    finish(main())


if __name__ == "__main__":
    console()
