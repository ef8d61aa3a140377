"""A network partition mid-training (issue 13, item 2): both nodes stop within the hang timeout plus 15 s, each
with a `loom run:` line naming the node it lost, and no raw traceback."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

LOOM = [sys.executable, "-m", "loom.cli"]
WORKER = Path(__file__).parent / "workers" / "launch_partition.py"
HANG_S = 10


def _can_make_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class _Output:
    """A node's combined output, read by a thread, with the time each line arrived."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in iter(proc.stdout.readline, ""):
            self.lines.append(line)

    def steps(self) -> int:
        return sum(1 for line in list(self.lines) if "]: step " in line)

    def text(self) -> str:
        return "".join(self.lines)


@pytest.mark.timeout(150)
@pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and iproute2 for network namespaces")
def test_a_partition_stops_both_nodes_naming_each_other(tmp_path):
    tag = f"{os.getpid() % 100000}"
    hosts, links, addrs = (
        [f"loomp{tag}a", f"loomp{tag}b"],
        [f"lp{tag}a", f"lp{tag}b"],
        ["10.77.94.1", "10.77.94.2"],
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free here; the namespaces are fresh
    env = dict(os.environ, LOOM_JOB_SECRET=os.urandom(32).hex(), LOOM_HANG_TIMEOUT_S=str(HANG_S))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKER.parent), env.get("PYTHONPATH")]))
    env.pop("GLOO_SOCKET_IFNAME", None)
    nodes: list[subprocess.Popen] = []
    try:
        for host in hosts:
            _ip("netns", "add", host)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for host, link, addr in zip(hosts, links, addrs, strict=True):
            _ip("link", "set", link, "netns", host)
            _ip("-n", host, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", host, "link", "set", link, "up")
            _ip("-n", host, "link", "set", "lo", "up")
        for node, host in enumerate(hosts):
            cmd = ["ip", "netns", "exec", host, *LOOM, "run", "-n", "1", "--nnodes", "2", "--node-rank", str(node),
                   "--master", f"{addrs[0]}:{port}", "--run-dir", str(tmp_path / host), str(WORKER)]  # fmt: skip
            nodes.append(
                subprocess.Popen(
                    cmd,
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )  # fmt: skip
            )
        outputs = [_Output(p) for p in nodes]
        deadline = time.monotonic() + 90
        while min(o.steps() for o in outputs) < 5:
            assert time.monotonic() < deadline, [o.text()[-2000:] for o in outputs]
            assert all(p.poll() is None for p in nodes), [o.text()[-2000:] for o in outputs]
            time.sleep(0.2)
        _ip("-n", hosts[0], "link", "set", links[0], "down")  # the cut: no reset, packets just stop
        cut = time.monotonic()
        ended = []
        for p in nodes:
            p.wait(timeout=HANG_S + 15 + 5)
            ended.append(time.monotonic() - cut)
        for o in outputs:
            o.thread.join(timeout=5)
        texts = [o.text() for o in outputs]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for host in hosts:
            pids = subprocess.run(
                ["ip", "netns", "pids", host], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", host], capture_output=True)
    print("seconds from the cut to each node's exit:", [round(t, 1) for t in ended])
    assert all(p.returncode != 0 for p in nodes), texts
    assert all(t < HANG_S + 15 for t in ended), (ended, texts)
    names = [f"node 1 ({addrs[1]})", f"node 0 (the master at {addrs[0]}:{port})"]
    for text, name in zip(texts, names, strict=True):
        lost = [line for line in text.splitlines() if line.startswith("loom run:") and name in line]
        assert lost, text[-3000:]
        print("\n".join(line for line in text.splitlines() if "loom run:" in line or "watchdog" in line))
        assert "Traceback" not in text, text[-3000:]
