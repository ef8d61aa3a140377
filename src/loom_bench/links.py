"""All-reduce on real (virtual) links: hosts in network namespaces, joined by veth pairs, limited by ``tc tbf``.

    sudo loom bench links [--quick] [--out benchmarks/reports]     (or: python -m loom_bench.links)

Each "host" is a network namespace; two are joined by a veth pair, three by veth pairs to a bridge in a
namespace of its own; every veth end is shaped with a token bucket filter (``tc ... root tbf rate R``: this
kernel has no ``netem``, so bandwidth is limited but no delay added). In each namespace
``loom run -n 1 --nnodes K --node-rank i --master 10.77.0.1:PORT`` starts one worker of
`loom_bench.links_worker`, which times native, ring and driver all-reduce; the launcher binds gloo to the veth
holding the node's address. The figure of merit is the achieved bus bandwidth (``2 (N-1)/N * D``
bytes each way per call, see `loom.comm.counters`) as a fraction of the link rate: a bandwidth-optimal ring
should come close to 1 on a full-duplex link. Then a second job (`loom_bench.links_dp_worker`) times
`loom.DataParallel` steps of the benchmark MLP uncompressed and with ``powersgd:4`` and ``topk:0.01``
compression, on 2 and on 3 hosts at each rate: what compression buys on a slow link.

Writes ``links.md``, ``links.json`` and ``links.png``. Needs root (``ip netns``, ``tc``); without it, prints why
and returns 0. Namespaces and links get names unique to this run and are deleted in ``finally`` (deleting a
namespace deletes its veth end, hence the pair); every process of a job runs in its own session and is killed
with all it started when the job ends, fails or times out;
addresses are in 10.77.0.0/24, inside the namespaces only. Limits: one process per host; the token bucket's
burst lets short messages exceed the rate, so sizes are chosen to take well over 100 ms at the limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["Hosts", "run_job", "run_links_benchmark", "skip_reason"]

RATES = {"1gbit": 1e9, "100mbit": 1e8}
SIZES = {"1gbit": 16 << 20, "100mbit": 4 << 20}
"""Bytes all-reduced at each rate: ~130 ms and ~340 ms at the limit for 2 hosts, far above the burst."""
TIMEOUT_S = 300.0
"""Longest one job (all-reduce, or DataParallel steps) may take before everything it started is killed."""
CODECS = "powersgd:4,topk:0.01"


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root. HINT: run it as root (sudo)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"missing tools: {', '.join(missing)} (iproute2)" if missing else None


class Hosts:
    """``k`` namespaces with addresses 10.77.0.1..k; `close` deletes everything made.

    Two hosts: one veth pair between them. Three or more: a bridge in its own namespace and a veth pair from
    each host to it. Every veth end is shaped by `limit`, so each host's link is limited in both directions.
    """

    def __init__(self, k: int) -> None:
        if not 2 <= k <= 9:
            raise ValueError(f"Hosts needs 2 to 9 hosts, got {k}")
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.namespaces = [f"loom{tag}h{i}" for i in range(k)]
        self.addresses = [f"10.77.0.{i + 1}" for i in range(k)]
        self.links: list[str] = []
        """Host ends, one per namespace (names under 15 characters: IFNAMSIZ)."""
        self.shaped: list[tuple[str, str]] = []
        """(namespace, device) of every veth end to limit."""
        self._made: list[str] = []
        try:
            for ns in self.namespaces:
                self._add_namespace(ns)
            if k == 2:
                self.links = [f"lv{tag}a", f"lv{tag}b"]
                self._veth(self.links[0], self.namespaces[0], self.links[1], self.namespaces[1])
            else:
                bridge = f"loom{tag}br"
                self._add_namespace(bridge)
                _sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
                _sh("ip", "-n", bridge, "link", "set", "br0", "up")
                for i, ns in enumerate(self.namespaces):
                    host_end, bridge_end = f"lv{tag}{i}", f"lb{tag}{i}"
                    self.links.append(host_end)
                    self._veth(host_end, ns, bridge_end, bridge)
                    _sh("ip", "-n", bridge, "link", "set", bridge_end, "master", "br0")
                    _sh("ip", "-n", bridge, "link", "set", bridge_end, "up")
            for ns, link, addr in zip(self.namespaces, self.links, self.addresses, strict=True):
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", link)
                _sh("ip", "-n", ns, "link", "set", link, "up")
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._made.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _veth(self, a: str, ns_a: str, b: str, ns_b: str) -> None:
        # Created inside ns_a, so that a failure half-way leaves nothing in the root namespace.
        _sh("ip", "-n", ns_a, "link", "add", a, "type", "veth", "peer", "name", b, "netns", ns_b)
        self.shaped += [(ns_a, a), (ns_b, b)]

    def limit(self, rate: str) -> None:
        for ns, link in self.shaped:
            _sh("tc", "-n", ns, "qdisc", "replace", "dev", link, "root", "tbf", "rate", rate, "burst", "256kb",
                "latency", "100ms")  # fmt: skip

    def close(self) -> None:
        """Kill whatever still runs in the namespaces (only this run's: their names are unique), delete them."""
        for ns in self._made:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in self._made:  # deleting a namespace deletes its veth ends, hence the pairs
            with contextlib.suppress(subprocess.CalledProcessError):
                _sh("ip", "netns", "del", ns)
        self._made = []


def run_job(
    hosts: Hosts, worker: str, worker_args: list[str], tmp: Path, timeout_s: float = TIMEOUT_S
) -> None:
    """Run module ``worker`` as a `loom run` job, one node per namespace; kill them all on failure or after
    ``timeout_s``."""
    port = 29500 + secrets.randbelow(2000)
    secret = secrets.token_hex(32)  # one job secret for all nodes, as a multi-node job needs
    procs = []
    try:
        nnodes, master = str(len(hosts.namespaces)), f"{hosts.addresses[0]}:{port}"
        for i, ns in enumerate(hosts.namespaces):
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "loom.cli", "run", "-n", "1",
                   "--nnodes", nnodes, "--node-rank", str(i), "--master", master,
                   "--local-addr", hosts.addresses[i], "--run-dir", str(tmp / f"run{i}"),
                   "-m", worker, *worker_args]  # fmt: skip
            # Each namespace is a host of its own: without a host id of its own, loom sees one machine (same
            # host name and boot id) and its shared-memory algorithms would bypass the shaped link.
            env = dict(os.environ, OMP_NUM_THREADS="1", LOOM_JOB_SECRET=secret, LOOM_HOST_ID=f"netns-{ns}")
            env.pop("GLOO_SOCKET_IFNAME", None)  # the launcher picks the veth holding --local-addr
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"links job failed (exit codes {[p.poll() for p in procs]}) or timed out")
            time.sleep(0.1)
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"links job failed: exit codes {[p.returncode for p in procs]}")
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_links_benchmark(
    out_dir: Path | str, reps: int = 5, host_counts: tuple[int, ...] = (2, 3), quick: bool = False
) -> int:
    """Time all-reduce algorithms and compressed `loom.DataParallel` steps at each rate of `RATES`.

    ``reps`` timed all-reduce calls per algorithm; DataParallel: 3 repetitions of 5 timed steps per
    configuration (``quick``: 3 calls, 1 repetition of 3 steps). Writes ``links.md``, ``links.json`` and
    ``links.png`` into ``out_dir``; returns a process exit code (0 when skipped).
    """
    reason = skip_reason()
    if reason:
        print(f"loom bench links: skipped: {reason}")
        return 0
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reps, dp_reps, dp_steps = (3, 1, 3) if quick else (reps, 3, 5)
    started, load_before = time.time(), os.getloadavg()[0]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="loom-links-") as tmp:
        for k in host_counts:
            hosts = Hosts(k)
            try:
                for rate, bits in RATES.items():
                    hosts.limit(rate)
                    job = Path(tmp) / f"{k}-{rate}"
                    print(
                        f"loom bench links: {k} hosts, {rate}, {SIZES[rate] >> 20} MiB all-reduce", flush=True
                    )
                    args = ["--bytes", str(SIZES[rate]), "--reps", str(reps), "--out", str(job / "ar.json")]
                    run_job(hosts, "loom_bench.links_worker", args, job / "ar")
                    found = json.loads((job / "ar.json").read_text())
                    for r in found["results"].values():
                        r["fraction_of_link"] = r["bus_bits_per_s"] / bits
                    print(f"loom bench links: {k} hosts, {rate}, DataParallel steps", flush=True)
                    args = ["--codecs", CODECS, "--steps", str(dp_steps), "--repetitions", str(dp_reps),
                            "--out", str(job / "dp.json")]  # fmt: skip
                    run_job(hosts, "loom_bench.links_dp_worker", args, job / "dp")
                    dp = json.loads((job / "dp.json").read_text())
                    runs.append({"hosts": k, "rate": rate, **found, **dp})
            except RuntimeError as error:
                print(f"loom bench links: {error}", file=sys.stderr)
                return 1
            finally:
                hosts.close()
    summary = {
        "command": "loom bench links"
        + (" --quick" if quick else f" --repetitions {reps}" if reps != 5 else ""),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "seconds": time.time() - started,
        "reps": reps,
        "dp_reps": dp_reps,
        "dp_steps": dp_steps,
        "runs": runs,
    }
    (out_dir / "links.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "links.md").write_text(_markdown(summary))
    _plot(summary, out_dir / "links.png")
    print(_markdown(summary))
    return 0


def _markdown(s: dict) -> str:
    lines = [
        "# All-reduce and compressed DataParallel on bandwidth-limited links (network namespaces, veth, tc tbf)",
        "",
        f"Command: `{s['command']}` as root ({s['date']}; load average {s['load_before']:.1f} before, "
        f"{s['load_after']:.1f} after; {s['seconds']:.0f} s). Hosts are network namespaces: 2 joined "
        "by a veth pair, 3 by veth pairs to a bridge in its own namespace; every veth end shaped with "
        "`tc ... tbf` (no netem: no added delay); one process per host, `loom run -n 1 --nnodes K "
        f"--node-rank i --master 10.77.0.1:PORT`; median of {s['reps']} timed calls after a warm-up, each the "
        "slowest rank's. Achieved bandwidth = bus bytes (`2 (N-1)/N * D` each way per process) / time.",
        "",
        "| hosts | link | message | algorithm | time (ms) | achieved (Mbit/s) | fraction of link |",
        "|---:|---|---:|---|---:|---:|---:|",
    ]
    for run in s["runs"]:
        for algorithm, r in run["results"].items():
            lines.append(
                f"| {run['hosts']} | {run['rate']} | {run['bytes'] >> 20} MiB | {algorithm} | "
                f"{r['seconds'] * 1e3:.0f} | {r['bus_bits_per_s'] / 1e6:.0f} | {r['fraction_of_link']:.2f} |"
            )
    lines += [
        "",
        "`loom.DataParallel` step time on the limited link (MLP 784-1024-1024-10, 7.5 MB of gradients, global "
        f"batch 256, SGD; median of {s['dp_reps']} x {s['dp_steps']} timed steps after 2 warm-up steps per "
        "repetition, configurations rotated; uncompressed = `DataParallel(allreduce='native')`, DDP's gloo "
        "all-reduce; compressed = `DataParallel(compression=...)`):",
        "",
        "| hosts | link | configuration | step (ms) | speedup vs uncompressed |",
        "|---:|---|---|---:|---:|",
    ]
    for run in s["runs"]:
        base = run["dp_step_s"]["uncompressed"]
        for name, seconds in run["dp_step_s"].items():
            lines.append(
                f"| {run['hosts']} | {run['rate']} | {name} | {seconds * 1e3:.0f} | {base / seconds:.2f} |"
            )
    return "\n".join([*lines, "", "![fraction of the link and DataParallel speedups](links.png)", ""])


def _plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{run['hosts']} hosts\n{run['rate']}" for run in s["runs"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for panel, key, values_of, ylabel in (
        (left, "results", lambda r, a: r["results"][a]["fraction_of_link"], "achieved / link rate"),
        (right, "dp_step_s", lambda r, a: r["dp_step_s"]["uncompressed"] / r["dp_step_s"][a], "speedup"),
    ):
        names = list(s["runs"][0][key])
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            xs = [x + (i - (len(names) - 1) / 2) * width for x in range(len(labels))]
            values = [values_of(run, name) for run in s["runs"]]
            bars = panel.bar(xs, values, width, label=name)
            panel.bar_label(bars, [f"{v:.2f}" for v in values], fontsize=7)
        panel.set_xticks(range(len(labels)), labels)
        panel.set_ylabel(ylabel)
        panel.grid(True, axis="y", alpha=0.3)
        panel.legend(fontsize=8)
    left.axhline(0.85, color="k", linestyle="--", linewidth=0.8)
    left.set_title("all-reduce bus bandwidth as a fraction of the link")
    right.set_title("DataParallel step speedup vs uncompressed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loom_bench.links", description=__doc__.split("\n")[0])
    parser.add_argument("--out", "--out-dir", type=Path, default=Path("benchmarks/reports"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    return run_links_benchmark(args.out, args.reps, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
