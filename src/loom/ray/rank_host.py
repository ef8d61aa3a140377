"""`RankHost`: the Ray actor that holds one process of a loom job (a worker rank or a parameter server).

The actor starts the process as `loom run` does (``python -u -m loom.ray.rank_main [-m] TARGET ARGS``) and answers
the driver's polls (`RankHost.poll`). Why a process beside the actor rather than the user's code inside it: the
process is then exactly what `loom run` starts (a fresh interpreter for every attempt), the actor stays free to
answer polls while the rank trains, and the process dies with the actor (`loom.launch.worker` asks for
PDEATHSIG). The actor imports nothing of loom (nor torch): the driver sends this module by value
(`ship_by_value`), and the process completes its environment itself (`loom.ray.rank_main`).

Files: a process on the driver's node writes into the job's run directory itself; elsewhere (or when the driver
asks for copies) into a private directory on its node, whose new bytes `poll` returns (at most
`FILE_BYTES_PER_POLL`; a file that shrank is sent again from its start) for the driver to write at the same path.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

__all__ = ["FILE_BYTES_PER_POLL", "LINE_CHARS", "RankHost", "remove_directories", "ship_by_value"]

FILE_BYTES_PER_POLL = 8 << 20
"""Most file bytes one poll returns (the rest comes with the next polls)."""
LINE_CHARS = 16 << 10
"""Longest output line passed on; longer ones are cut (the log file keeps them whole)."""
_PENDING_LINES = 20_000
"""Output lines kept between two polls; older ones are dropped (and counted) when a rank prints faster."""


def ship_by_value() -> None:
    """Have Ray send this module's code to the actors instead of a reference to it, which they would import
    with the whole of loom and torch (seconds and hundreds of MB per actor)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def remove_directories(paths: list[str]) -> None:
    """Remove the private directories of processes whose actors died (a Ray task on their node)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class RankHost:
    """One process of the job, on the node Ray placed this actor on (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.lines: deque[tuple[str, str]] = deque(maxlen=_PENDING_LINES)
        self.dropped = 0
        self.lock = threading.Lock()
        self.readers: list[threading.Thread] = []
        self.sync_root: Path | None = None
        self.sent: dict[str, int] = {}
        self.error_file: Path | None = None
        self.result: bytes | None = None
        self.ended_at: float | None = None
        """Wall-clock time the process ended (which of several failed ranks failed first)."""
        self.listener: socket.socket | None = None
        """A parameter server's listening socket (`listen`), held from choosing its port to the server's end."""

    # -- where the actor runs -------------------------------------------------------------------------------
    def where(self) -> dict[str, Any]:
        """This node's Ray id and address, the GPUs Ray gave this actor, its pid and host name."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    def listen(self) -> int:
        """Bind and listen on a free TCP port of this node's address, and return it: the socket is handed to the
        process `start` starts (``--listen-fd``, as ``loom run --servers`` does), so the port is never free
        between being chosen and the server's start (a port only probed free could be taken in between)."""
        import ray

        if self.listener is None:
            address = ray.util.get_node_ip_address()
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            self.listener = socket.create_server((address, 0), family=family, backlog=128)  # SO_REUSEADDR set
            self.listener.set_inheritable(True)
        return int(self.listener.getsockname()[1])

    # -- the process ------------------------------------------------------------------------------------------
    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        run_dir: str | None,
        log_name: str,
        payload: bytes | None = None,
    ) -> str | None:
        """Start ``python ARGV`` in ``cwd`` with ``env`` added to this actor's environment (less Ray's token).

        ``run_dir``: the job's run directory, when this node writes into it directly; None: write into a private
        directory here (in the temporary directory), which `poll` copies out. ``log_name``: the output goes to
        ``logs/LOG_NAME.stdout.log`` and ``.stderr.log`` there. ``payload`` (a function to run, see
        `loom.ray.function`) is written to the process's stdin. Returns the private directory, if any (the
        driver removes it should this actor die)."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name}: a process was started already (pid {self.proc.pid})")
        self.name = Path(log_name).name  # the rank (or server) it now is
        if not Path(cwd).is_dir():
            raise FileNotFoundError(
                f"{self.name}: the working directory {cwd!r} does not exist on node {socket.gethostname()}. "
                "HINT: run the driver from a directory every node has at the same path (a shared filesystem)"
            )
        root = Path(run_dir or tempfile.mkdtemp(prefix=f"loom-ray-{self.name}-"))
        self.sync_root = None if run_dir else root
        log_base = root / "logs" / log_name
        log_base.parent.mkdir(parents=True, exist_ok=True)
        self.error_file = log_base.with_name(log_base.name + ".error.json")
        self.error_file.unlink(missing_ok=True)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
        full_env.update(env, LOOM_RUN_DIR=str(root), TORCHELASTIC_ERROR_FILE=str(self.error_file))
        result_r, result_w = os.pipe() if payload is not None else (None, None)
        if result_w is not None:
            full_env["LOOM_RAY_RESULT_FD"] = str(result_w)
        fds = [result_w] if result_w is not None else []
        if self.listener is not None:
            argv = [*argv, "--listen-fd", str(self.listener.fileno())]
            fds.append(self.listener.fileno())
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            cwd=cwd,
            env=full_env,
            stdin=subprocess.PIPE if payload is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=tuple(fds),
        )
        self._thread(self._note_end, self.proc)
        for stream, kind in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr")):
            path = log_base.with_name(f"{log_base.name}.{kind}.log")
            self._thread(self._pump, stream, kind, path)
        if payload is not None and result_r is not None and result_w is not None:
            os.close(result_w)
            self.result = b""
            self._thread(self._feed, self.proc.stdin, payload)
            self._thread(self._collect_result, result_r)
        return str(self.sync_root) if self.sync_root is not None else None

    def _thread(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.readers.append(thread)

    def _note_end(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self.ended_at = time.time()

    def _pump(self, stream: IO[bytes], kind: str, path: Path) -> None:
        with open(path, "ab") as log:
            for raw in iter(stream.readline, b""):
                log.write(raw)
                log.flush()
                text = raw.decode(errors="replace").rstrip("\n")
                with self.lock:
                    if len(self.lines) == self.lines.maxlen:
                        self.dropped += 1  # counts the line the append below drops
                    self.lines.append((kind, text[:LINE_CHARS]))

    def _feed(self, stdin: IO[bytes], payload: bytes) -> None:
        with contextlib.suppress(OSError):  # the process died before reading it: its exit status says why
            stdin.write(payload)
            stdin.close()

    def _collect_result(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            self.result = pipe.read()  # the pickled return value, once the process closes the pipe

    def poll(self) -> dict[str, Any]:
        """What happened since the last poll: ``exit`` (None while running, else the exit status, negative for a
        signal), ``error`` (the exception the process recorded), ``lines`` [(stream, text)], ``dropped`` (lines
        lost to a full buffer), ``files`` [(path relative to the run directory, offset, bytes)] and, once the
        process has ended and its output is drained, ``done`` and ``result`` (a function's pickled return)."""
        if self.proc is None:
            return {"exit": None, "error": None, "lines": [], "dropped": 0, "files": [], "done": False}
        code = self.proc.poll()
        drained = code is not None and not any(t.is_alive() for t in self.readers)
        with self.lock:
            lines, dropped = list(self.lines), self.dropped
            self.lines.clear()
            self.dropped = 0
        files = self._new_file_bytes()
        done = drained and not files
        return {
            "exit": code,
            "ended_at": self.ended_at,
            "error": self._recorded_error() if code else None,
            "lines": lines,
            "dropped": dropped,
            "files": files,
            "done": done,
            "result": self.result if done and code == 0 else None,
        }

    def _recorded_error(self) -> str | None:
        """The ``Type: message`` line `loom.launch.worker` records on an uncaught exception."""
        try:
            data = json.loads(self.error_file.read_text()) if self.error_file else {}
        except (OSError, ValueError):
            return None
        message = data.get("message")
        if isinstance(message, dict):
            message = message.get("message")
        return str(message).strip().splitlines()[-1] if message else None

    def _new_file_bytes(self) -> list[tuple[str, int, bytes]]:
        if self.sync_root is None:
            return []
        budget, chunks = FILE_BYTES_PER_POLL, []
        for path in sorted(p for p in self.sync_root.rglob("*") if p.is_file()):
            rel = path.relative_to(self.sync_root).as_posix()
            size = path.stat().st_size
            offset = self.sent.get(rel, 0)
            if size < offset:  # rewritten since: send it again from the start
                offset = 0
            if (size == offset and rel in self.sent) or budget <= 0:
                continue  # nothing new (an empty file is sent once, so that it exists there too)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(min(size - offset, budget))
            budget -= len(data)
            self.sent[rel] = offset + len(data)
            chunks.append((rel, offset, data))
        return chunks

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM the process, SIGKILL it after ``grace_s``; returns its exit status. The private directory is
        kept until `cleanup` (the driver polls its last bytes first)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        return self.proc.returncode

    def cleanup(self) -> None:
        """Remove the private directory (after the driver has copied it)."""
        if self.sync_root is not None:
            shutil.rmtree(self.sync_root, ignore_errors=True)
