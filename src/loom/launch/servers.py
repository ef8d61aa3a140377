"""Parameter-server processes started beside the workers by ``loom run --servers K``, watched and restarted.

The servers are not part of the elastic worker group: they start before it, survive worker restarts, and are
stopped (SIGTERM, then SIGKILL) once the workers are done; each dies with the launcher too (`start_server`).
Workers learn the addresses from ``LOOM_PS_ADDRS``; every process gets the job secret in ``LOOM_JOB_SECRET``.

The launcher binds each server's listening socket itself and hands it to the server (``--listen-fd``), keeping its
own copy: the port is never free, neither before the server's start nor while a dead server is restarted, so no
other local process can listen there and take a worker's connection token from its handshake; connections made
meanwhile wait in the socket's backlog.

A server that exits while the job runs is restarted on the same address (the workers know only that) and resumes
from its checkpoint in ``$LOOM_RUN_DIR/ps`` (`loom.ps.server`); one line says so. Past ``max_restarts`` deaths of
one server the job stops (`ServerGroup.failure`): a server that keeps dying is a bug or a broken host, not bad
luck. Every death goes into ``$LOOM_RUN_DIR/ps-servers.json`` (`loom.ps.deaths`), which a worker whose request
times out reads to name the cause; exits once the servers are being stopped are not deaths.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.launch.supervise import exit_cause, pump, stop_processes
from loom.ps.deaths import write_record

__all__ = ["ServerGroup", "wait_for_servers"]


def start_server(
    index: int,
    count: int,
    address: str,
    env: dict[str, str] | None = None,
    listener: socket.socket | None = None,
) -> subprocess.Popen:
    """Server ``index`` of ``count`` (``loom.ps.server`` through `loom.launch.worker`, so it dies with the
    launcher) on ``address``, listening on ``listener`` when given; its lines go to our output after
    ``[serverI]: ``."""
    cmd = [sys.executable, "-u", "-m", "loom.launch.worker", "-m", "loom.ps.server",
           "--index", str(index), "--num-servers", str(count), "--bind", address]  # fmt: skip
    fds = () if listener is None else (listener.fileno(),)
    cmd += [arg for fd in fds for arg in ("--listen-fd", str(fd))]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, pass_fds=fds
    )
    threading.Thread(target=pump, args=(proc.stdout, f"[server{index}]: "), daemon=True).start()
    return proc


def _listen(host: str) -> socket.socket:
    """A TCP socket listening on a free port of ``host``, inheritable by the server processes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(128)
    listener.set_inheritable(True)
    return listener


def _stop_this_launcher() -> None:
    """SIGTERM to this process: the launcher's own handler stops the workers (`loom.launch.agent`)."""
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class _Server:
    index: int
    address: str
    proc: subprocess.Popen
    restarts: int = 0
    state: str = "running"
    deaths: list[dict[str, Any]] = field(default_factory=list)


class ServerGroup:
    """The job's servers: started, watched by a thread, restarted up to ``max_restarts`` times each."""

    def __init__(
        self,
        count: int,
        bind_host: str,
        max_restarts: int,
        run_dir: Path | None,
        on_failure: Callable[[], None] = _stop_this_launcher,
    ) -> None:
        self.count = count
        self.listeners = [_listen(bind_host) for _ in range(count)]
        """Each server's listening socket, held by the launcher (see the module docstring)."""
        self.addresses = [f"{bind_host}:{s.getsockname()[1]}" for s in self.listeners]
        self.max_restarts = max_restarts
        self.run_dir = run_dir
        self.on_failure = on_failure
        self.failure: str | None = None
        """Why the job was stopped (a server died more than ``max_restarts`` times); None while it was not."""
        self.servers: list[_Server] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="loom-server-watch", daemon=True)

    @property
    def restarts(self) -> int:
        """Restarts of all servers so far."""
        return sum(s.restarts for s in self.servers)

    def start(self) -> None:
        for index, address in enumerate(self.addresses):
            self.servers.append(_Server(index, address, self._spawn(index, address)))
        self._write()
        self._watcher.start()

    def _spawn(self, index: int, address: str) -> subprocess.Popen:
        return start_server(index, self.count, address, listener=self.listeners[index])

    def _watch(self) -> None:
        while not self._stopping.wait(0.1):  # a dead server is noticed within 0.1 s
            for server in self.servers:
                if server.state != "running" or server.proc.poll() is None:
                    continue
                with self._lock:
                    if self._stopping.is_set():
                        return
                    self._died(server, server.proc.returncode)

    def _died(self, server: _Server, status: int) -> None:
        cause = exit_cause(status)
        restart = server.restarts < self.max_restarts
        server.deaths.append({"time": time.time(), "status": status, "cause": cause, "restarted": restart})
        if restart:
            server.restarts += 1
            print(f"loom run: parameter server {server.index} died ({cause}); restarting it from its checkpoint "
                  f"(restart {server.restarts} of {self.max_restarts})", file=sys.stderr, flush=True)  # fmt: skip
            try:
                server.proc = self._spawn(server.index, server.address)
                self._write()
                return
            except OSError as error:  # no process could be started: the job cannot go on either
                server.deaths[-1]["restarted"] = False
                self.failure = (f"parameter server {server.index} at {server.address} died ({cause}) and could "
                                f"not be restarted: {error}; stopping the job")  # fmt: skip
        else:
            self.failure = (f"parameter server {server.index} at {server.address} died ({cause}) after "
                            f"{server.restarts} restart(s), more than --max-server-restarts {self.max_restarts} "
                            "allows; stopping the job. HINT: its lines above (prefixed [server"
                            f"{server.index}]) show why it died")  # fmt: skip
        server.state = "dead"
        print(f"loom run: {self.failure}", file=sys.stderr, flush=True)
        self._write()
        self._stopping.set()
        self.on_failure()

    def _write(self) -> None:
        if self.run_dir is None:
            return
        record = [{"index": s.index, "address": s.address, "pid": s.proc.pid, "state": s.state,
                   "restarts": s.restarts, "max_restarts": self.max_restarts, "deaths": s.deaths}
                  for s in self.servers]  # fmt: skip
        try:
            write_record(self.run_dir, record)
        except OSError as error:  # the record helps explain; it must not take the job down
            print(
                f"loom run: could not write the servers' record into {self.run_dir}: {error}", file=sys.stderr
            )

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop watching, then stop every server (their exits now are not deaths)."""
        self._stopping.set()
        with self._lock:
            procs = [s.proc for s in self.servers]
            for server in self.servers:
                if server.state == "running":
                    server.state = "stopped"
        if self._watcher.is_alive() and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5.0)
        stop_processes(procs, grace_s)
        for listener in self.listeners:
            listener.close()
        self._write()


def wait_for_servers(
    addresses: list[str], timeout_s: float, poll_s: float = 0.5, notice_s: float = 10.0
) -> list[str]:
    """The ``ADDR:PORT`` of ``addresses`` that did not accept a TCP connection within ``timeout_s`` (none: all
    are up), saying every ``notice_s`` which ones it still waits for. A connection that is closed before
    ZeroMQ's greeting is dropped by the server unread."""
    began = time.monotonic()
    deadline, notice = began + timeout_s, began + notice_s
    waiting = list(addresses)
    while waiting:
        if time.monotonic() >= notice:
            notice += notice_s
            print(f"loom run: waiting for parameter server(s) {', '.join(waiting)} to accept a connection "
                  f"({time.monotonic() - began:.0f} s of --join-timeout {timeout_s:g} s); start their host",
                  file=sys.stderr, flush=True)  # fmt: skip
        for address in list(waiting):
            host, _, port = address.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=min(2.0, timeout_s)).close()
                waiting.remove(address)
            except OSError:
                pass
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    return waiting
