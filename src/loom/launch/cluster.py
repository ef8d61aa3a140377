"""A cluster spec for plain hosts: one JSON file lists the hosts and their roles; every host runs the same command.

The format, an example, how this host is found and the error shape: docs/launching.md ("Cluster spec"); its
bounds (`MAX_SPEC_BYTES`, `MAX_SPEC_NESTING`, `MAX_SERVER_PORTS`, each host's processes by its cores):
docs/fault-tolerance.md ("Launcher input bounds"). As with TensorFlow's ``TF_CONFIG``, the spec describes the job
once and each process is told its place in it; a malformed spec fails before anything starts, and no name is
resolved while checking it.

Nothing new is launched: the spec maps onto the multi-node launcher (`loom.launch.agent`). Worker hosts, in listed
order, are nodes ``0..W-1`` with their own ``--nproc`` and ``--local-addr``, and wait at most ``--join-timeout``
for every server of the spec to accept a connection. A server host is not a node of the rendezvous: its servers
(one ``loom.ps.server`` per port, numbered across server hosts in listed order; workers learn them from
``LOOM_PS_ADDRS``) run until node 0's store, once reached with the job secret, has gone; it then exits 0 (the
worker hosts' statuses say whether the workers succeeded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from loom.errors import ClusterSpecError  # noqa: F401 - raised here, defined there
from loom.launch.bounds import MAX_SPEC_NESTING, check_nproc, json_nesting_depth, read_regular_file, refuse
from loom.settings import SettingError, setting

__all__ = [
    "MAX_SERVER_PORTS",
    "MAX_SPEC_BYTES",
    "ClusterSpec",
    "Host",
    "load_cluster",
    "pick_host",
    "run_host",
]

MAX_SPEC_BYTES = 1 << 20
"""Largest spec read; a longer file (or ``LOOM_CLUSTER`` value) is refused unread past this."""
MAX_SERVER_PORTS = 1024
"""Most parameter servers (ports over all server hosts) a spec may list; ``LOOM_PS_ADDRS`` stays under 32 KiB."""
ROLES = ("worker", "server")
_FIELDS = {"worker": {"address", "role", "nproc"}, "server": {"address", "role", "ports"}}
_STORE_POLL_S = 1.0
"""How often a server host checks that node 0's store is still there."""
_MISSED_PINGS = 3
"""Pings of node 0's store in a row that must fail before a server host decides the job has ended."""


@dataclass(frozen=True)
class Host:
    """One host of the spec."""

    address: str
    """The IPv4 address (or name) the other hosts reach this one at; its processes listen there."""
    role: str
    """``worker`` (training processes) or ``server`` (parameter-server processes)."""
    nproc: int = 0
    """Worker processes on this host (workers only)."""
    ports: tuple[int, ...] = ()
    """One parameter-server process per port (servers only)."""


@dataclass(frozen=True)
class ClusterSpec:
    """The job's hosts, validated: at least one worker host, addresses unique, ports in 1..65535."""

    hosts: tuple[Host, ...]
    master_port: int
    """Port of node 0's rendezvous store, on the first worker host's address."""
    source: str = "cluster spec"
    """Where the spec came from (a path or ``LOOM_CLUSTER``), for messages."""

    @property
    def workers(self) -> list[Host]:
        return [h for h in self.hosts if h.role == "worker"]

    @property
    def master(self) -> str:
        return f"{self.workers[0].address}:{self.master_port}"

    @property
    def server_addresses(self) -> list[str]:
        return [f"{h.address}:{port}" for h in self.hosts if h.role == "server" for port in h.ports]


def _fail(source: str, field: str, problem: str, fix: str) -> ClusterSpecError:
    return ClusterSpecError(f"{source}: {field} {problem}. HINT: {fix}")


def _short(value: Any, width: int = 60) -> str:
    """``repr(value)``, cut to ``width`` characters: a message stays one readable line whatever the spec holds."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _port(value: Any, source: str, field: str) -> int:
    fail = partial(_fail, source)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise fail(
            field, f"is {_short(value)}, not a port", "give an integer in 1..65535 that nothing else uses"
        )
    return value


def _host(entry: Any, index: int, source: str) -> Host:
    where, fail = f"hosts[{index}]", partial(_fail, source)
    if not isinstance(entry, dict):
        raise fail(where, f"is {type(entry).__name__}, not an object", 'write {"address": ..., "role": ...}')
    for name in ("address", "role"):
        if name not in entry:
            raise fail(f"{where}.{name}", "is missing", f"every host needs {name!r}")
    address, role = entry["address"], entry["role"]
    if not isinstance(address, str) or not address.strip() or any(c.isspace() for c in address):
        raise fail(
            f"{where}.address", f"is {_short(address)}", "give the IPv4 address other hosts reach it at"
        )
    if role not in ROLES:
        raise fail(f"{where}.role", f"is {_short(role)}, an unknown role", f"use one of {', '.join(ROLES)}")
    unknown = sorted(set(entry) - _FIELDS[role])
    if unknown:
        raise fail(f"{where}.{unknown[0]}", f"is not a field of a {role} host",
                   f"a {role} host has {', '.join(sorted(_FIELDS[role]))}")  # fmt: skip
    if role == "worker":
        if "nproc" not in entry:
            raise fail(f"{where}.nproc", "is missing", "say how many worker processes this host runs")
        nproc = entry["nproc"]
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise fail(f"{where}.nproc", f"is {_short(nproc)}", "give an integer >= 1")
        return Host(address, role, nproc=nproc)
    if "ports" not in entry:
        raise fail(f"{where}.ports", "is missing", "list one port per parameter-server process")
    ports = entry["ports"]
    if not isinstance(ports, list) or not ports:
        raise fail(f"{where}.ports", f"is {_short(ports)}", "list one port per parameter-server process")
    checked = tuple(_port(p, source, f"{where}.ports[{i}]") for i, p in enumerate(ports))
    if len(set(checked)) != len(checked):
        raise fail(
            f"{where}.ports", f"repeats a port in {_short(list(checked))}", "give each server its own port"
        )
    return Host(address, role, ports=checked)


def parse_cluster(text: str, source: str = "cluster spec") -> ClusterSpec:
    """The spec in ``text`` (JSON), checked; `ClusterSpecError` names the first bad field."""
    fail = partial(_fail, source)
    depth = json_nesting_depth(text)
    if depth > MAX_SPEC_NESTING:
        raise fail("the JSON", f"is nested {depth} brackets deep (at most {MAX_SPEC_NESTING})",
                   "a cluster spec is an object with a list of host objects; check the file")  # fmt: skip
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as error:
        raise fail("the file", f"is not JSON ({error.msg} at line {error.lineno}, column {error.colno})",
                   "write one JSON object with 'master_port' and 'hosts'") from None  # fmt: skip
    if not isinstance(raw, dict):
        raise fail("the top level", f"is {type(raw).__name__}", "write one JSON object")
    unknown = sorted(set(raw) - {"hosts", "master_port"})
    if unknown:
        raise fail(unknown[0], "is not a field of a cluster spec", "the top level has master_port, hosts")
    for name in ("master_port", "hosts"):
        if name not in raw:
            raise fail(name, "is missing", "the top level has master_port and hosts")
    master_port = _port(raw["master_port"], source, "master_port")
    if not isinstance(raw["hosts"], list) or not raw["hosts"]:
        raise fail("hosts", f"is {_short(raw['hosts'])}", "list the hosts, each with address and role")
    ports = sum(
        len(h["ports"]) for h in raw["hosts"] if isinstance(h, dict) and isinstance(h.get("ports"), list)
    )
    if ports > MAX_SERVER_PORTS:
        raise fail("hosts", f"list {ports} parameter-server ports in all (at most {MAX_SERVER_PORTS})",
                   "one port is one server process; list fewer")  # fmt: skip
    hosts = tuple(_host(entry, i, source) for i, entry in enumerate(raw["hosts"]))
    seen: dict[str, int] = {}
    for i, host in enumerate(hosts):
        if host.address in seen:
            raise fail(f"hosts[{i}].address", f"{host.address!r} is a duplicate host (also hosts[{seen[host.address]}])",
                       "list each host once; a host runs one role")  # fmt: skip
        seen[host.address] = i
    if not any(h.role == "worker" for h in hosts):
        raise fail("hosts", "has no worker host", 'add a host with "role": "worker" and "nproc"')
    return ClusterSpec(hosts, master_port, source)


def load_cluster(where: str) -> ClusterSpec:
    """The spec from a file path, or from JSON text itself (a ``LOOM_CLUSTER`` value starting with ``{``);
    at most `MAX_SPEC_BYTES` are read."""
    if where.lstrip().startswith("{"):
        if len(where.encode()) > MAX_SPEC_BYTES:
            raise _fail("LOOM_CLUSTER", "the value", f"is over {MAX_SPEC_BYTES} bytes", "point it at a file")
        return parse_cluster(where, "LOOM_CLUSTER")
    try:
        data = read_regular_file(where, MAX_SPEC_BYTES)
    except ValueError as error:
        raise ClusterSpecError(
            f"cannot read the cluster spec: {error}. HINT: give the path of a JSON file"
        ) from None
    except OSError as error:
        raise ClusterSpecError(f"cannot read the cluster spec {where!r}: {error.strerror or error}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise _fail(
            where, "the file", f"is over {MAX_SPEC_BYTES} bytes", "a cluster spec lists hosts; check the path"
        )
    try:
        return parse_cluster(data.decode("utf-8"), where)
    except UnicodeDecodeError:
        raise _fail(where, "the file", "is not UTF-8 text", "write the spec as JSON text") from None


def pick_host(spec: ClusterSpec, index: int | None) -> int:
    """This host's index: ``index`` checked, else ``LOOM_HOST_INDEX``, else the one spec host whose address an
    interface of this machine holds."""
    if index is None:
        try:
            index = setting("LOOM_HOST_INDEX")
        except SettingError as error:
            raise ClusterSpecError(str(error)) from None
    last = len(spec.hosts) - 1
    if index is not None:
        if not 0 <= index <= last:
            raise ClusterSpecError(f"--host-index {index} is out of range: {spec.source} lists hosts 0..{last}. "
                                   "HINT: give this host's position in 'hosts'")  # fmt: skip
        return index
    from loom.net.interfaces import interface_of

    mine = [i for i, h in enumerate(spec.hosts) if interface_of(h.address) is not None]
    if len(mine) != 1:
        found = "none" if not mine else f"hosts {mine}"
        raise ClusterSpecError(f"cannot tell which host of {spec.source} this is: {found} of its addresses is on "
                               "this machine. HINT: pass --host-index K (or LOOM_HOST_INDEX)")  # fmt: skip
    return mine[0]


def run_host(spec: ClusterSpec, index: int, options: dict[str, Any]) -> int:
    """Run host ``index`` of ``spec``: the launcher for a worker host, the parameter servers for a server host.
    ``options`` are the other `loom.launch.spec.LaunchSpec` fields (target, args, run_dir, ...)."""
    host = spec.hosts[index]
    if options.get("on_worker_failure") == "continue" and spec.server_addresses:
        return refuse("loom run: --on-worker-failure continue runs one node with its parameter servers beside it; a "
                      "cluster spec with server hosts runs with 'stop'. HINT: drop --on-worker-failure, or use loom "
                      "run -n N --servers K --on-worker-failure continue on one host")  # fmt: skip
    insecure_ok = options.get("insecure_no_secret") and not spec.server_addresses
    if len(spec.hosts) > 1 and not os.environ.get("LOOM_JOB_SECRET") and not insecure_ok:
        return refuse("loom run: a cluster of several hosts needs LOOM_JOB_SECRET, the same on every host: it "
                      "authenticates the store, the rendezvous and the parameter servers. HINT: export "
                      "LOOM_JOB_SECRET=$(openssl rand -hex 32) on every host")  # fmt: skip
    if host.role == "server":
        return _serve(spec, index, options["join_timeout_s"], options["run_dir"], options["max_nproc"])
    from loom.launch.agent import launch
    from loom.launch.spec import LaunchSpec

    workers = spec.workers
    try:
        check_nproc(host.nproc, options.get("max_nproc"), f"{spec.source}: hosts[{index}].nproc")
        launch_spec = LaunchSpec(
            nproc=host.nproc,
            nnodes=len(workers),
            node_rank=workers.index(host),
            master=spec.master,
            local_addr=host.address,
            **options,
        )
    except (ValueError, FileNotFoundError) as error:
        return refuse(f"loom run: {error}")
    if spec.server_addresses:
        from loom.launch.servers import wait_for_servers

        missing = wait_for_servers(spec.server_addresses, launch_spec.join_timeout_s)
        if missing:
            return refuse(f"loom run: parameter server(s) {', '.join(missing)} of {spec.source} did not accept a "
                          f"connection within --join-timeout {launch_spec.join_timeout_s:g} s; the workers were not "
                          "started. HINT: run the same loom run --cluster command on every server host", 1)  # fmt: skip
        os.environ["LOOM_PS_ADDRS"] = ",".join(spec.server_addresses)
    return launch(launch_spec)


def _serve(spec: ClusterSpec, index: int, join_timeout_s: float, run_dir: Path, max_nproc: int | None) -> int:
    """A server host: its servers run until node 0's store, once reached, is gone."""
    from loom.launch.servers import start_server
    from loom.launch.spec import master_host_port
    from loom.launch.supervise import exit_cause, stop_processes
    from loom.net.store import LoomStore, StoreUnreachable, job_secret

    addresses = spec.server_addresses
    mine = [(i, a) for i, a in enumerate(addresses) if a.rpartition(":")[0] == spec.hosts[index].address]
    try:
        master_host, master_port = master_host_port(spec.master)
        secret = job_secret()
        check_nproc(len(mine), max_nproc, f"{spec.source}: hosts[{index}].ports lists")
    except ValueError as error:
        return refuse(f"loom run: {error}")
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LOOM_RUN_DIR=str(run_dir.resolve()), PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    try:
        for i, address in mine:
            procs.append(start_server(i, len(addresses), address, env))
        print(f"loom run: servers {[a for _, a in mine]} started; waiting up to {join_timeout_s:g} s (--join-timeout) "
              f"for the job's first worker host at {spec.master}", file=sys.stderr, flush=True)  # fmt: skip
        first = LoomStore(
            master_host, master_port, secret, connect_timeout_s=join_timeout_s, io_timeout_s=30.0
        )
        try:
            first.ping()
        except StoreUnreachable as error:
            return refuse(f"loom run: this server host could not join the job: {error} (--join-timeout "
                          f"{join_timeout_s:g} s). HINT: start the first worker host too, with the same "
                          "LOOM_JOB_SECRET", 1)  # fmt: skip
        finally:
            first.close()
        print(f"loom run: servers {[a for _, a in mine]} joined the job at {spec.master}", file=sys.stderr)
        watch = LoomStore(master_host, master_port, secret, connect_timeout_s=2.0, io_timeout_s=30.0)
        missed = 0
        while True:
            time.sleep(_STORE_POLL_S)
            dead = [(i, p.returncode) for (i, _), p in zip(mine, procs, strict=True) if p.poll() is not None]
            if dead:
                return refuse(f"loom run: parameter server {dead[0][0]} ended ({exit_cause(dead[0][1])}) while the "
                              "job ran; see its lines above", 1)  # fmt: skip
            try:
                watch.ping()
                missed = 0
            except StoreUnreachable:
                missed += 1  # one lost ping is a blip of the network, not the end of the job
                if missed < _MISSED_PINGS:
                    continue
                print(
                    f"loom run: node 0's launcher has not answered {missed} pings in a row: it has ended; "
                    "stopping the parameter servers", file=sys.stderr,
                )  # fmt: skip
                return 0
    finally:
        stop_processes(procs, 5.0)
