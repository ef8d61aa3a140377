"""Liveness apart from slowness (issue 25, item 2): heartbeats on the watchdog's side channel.

The bookkeeping runs against a fake store and a fake clock; the real case cuts the link between two hosts
(network namespaces) mid-training, with a short liveness timeout and a hang timeout far above it, and with the
defaults (20 s, 180 s): both sides stop, each naming the other, long before the hang timeout would have. The
seconds from the cut to each exit are printed, not asserted (timing belongs in measurements).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from netns import bridged_hosts, can_make_namespaces

from loom.fault.liveness import Heartbeat
from loom.fault.timeouts import DEFAULT_LIVENESS_TIMEOUT_S, DEFAULT_TIMEOUT_S, liveness_timeout_s
from loom.fault.watchdog import Watchdog
from loom.train.guard import GuardOptions

PREFIX = "loom/watchdog/attempt0/"


class _Store:
    """The store calls the heartbeat makes (``add``, ``set``, ``check``, ``get``), in a dict; ``cut`` makes
    every call fail as a store whose host is unreachable does."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.cut = False
        self.calls = 0

    def _call(self) -> None:
        self.calls += 1
        if self.cut:
            raise ConnectionError("no answer from 10.0.0.1:29400 within 3 s")

    def add(self, key: str, amount: int) -> int:
        self._call()
        self.data[key] = str(int(self.data.get(key, "0")) + amount)
        return int(self.data[key])

    def set(self, key: str, value: str) -> None:
        self._call()
        self.data[key] = value

    def check(self, keys: list[str]) -> bool:
        self._call()
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        self._call()
        return self.data[key].encode()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ring(store: _Store, clock: _Clock, world: int = 3, started: int | None = None) -> list[Heartbeat]:
    """``world`` ranks' heartbeats with a timeout of 5 s; the first ``started`` (all) announced themselves."""
    beats = [Heartbeat(r, world, 5.0, PREFIX, clock=clock) for r in range(world)]
    for r, hb in enumerate(beats[:started]):
        hb.store_address = "10.0.0.1:29400"
        hb.announce(store, f"node {r}, 10.0.0.{r + 1}")  # its host, and a first beat
    return beats


def _tick(store: _Store, beats: list[Heartbeat], clock: _Clock, seconds: float = 1.0) -> None:
    clock.now += seconds
    for hb in beats:
        try:
            hb.beat(store)
        except ConnectionError as error:
            hb.store_failed(error)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_a_silent_peer_is_lost_after_the_liveness_timeout_and_named_with_its_host():
    store, clock = _Store(), _Clock()
    beats = _ring(store, clock)
    for _ in range(3):
        _tick(store, beats, clock)
    assert [hb.verdict() for hb in beats] == [None, None, None]
    assert (
        store.calls == 3 * 2 + 3 * (2 * 3) + 3 * 2
    )  # announce, two calls per rank per interval, one host read
    for _ in range(6):  # rank 1 stops beating (its host died); the first tick still reads its last beat
        _tick(store, [beats[0], beats[2]], clock)
    assert beats[0].verdict() is None
    _tick(store, [beats[0], beats[2]], clock)
    lost = beats[0].verdict()  # rank 0 watches rank 1 (the next on the ring)
    assert lost is not None and lost.startswith("lost rank 1 (node 1, 10.0.0.2): no heartbeat for 6 s")
    assert "(liveness_timeout_s=5, LOOM_LIVENESS_TIMEOUT_S)" in lost and "10.0.0.1:29400 answers" in lost
    assert beats[2].verdict() is None  # rank 2 watches rank 0, alive


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_a_peer_that_never_beat_or_left_on_purpose_is_not_judged():
    store, clock = _Store(), _Clock()
    beats = _ring(store, clock, world=2, started=1)
    for _ in range(20):  # rank 1 has not started its watchdog (still loading data): not lost
        _tick(store, beats[:1], clock)
    assert beats[0].verdict() is None
    _tick(store, beats, clock)
    beats[1].leave(store)  # rank 1's process ends normally
    for _ in range(20):
        _tick(store, beats[:1], clock)
    assert beats[0].verdict() is None


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_the_side_cut_off_from_the_store_names_the_store_and_the_peer_it_watched():
    store, clock = _Store(), _Clock()
    beats = _ring(store, clock, world=2)
    _tick(store, beats, clock)
    store.cut = True  # one failed call is a blip, not a cut
    _tick(store, beats[1:], clock)
    store.cut = False
    _tick(store, beats, clock, seconds=4.5)  # answered again: the silence starts over
    assert beats[1].verdict() is None
    store.cut = True
    for _ in range(5):
        _tick(store, beats[1:], clock)
    assert beats[1].verdict() is None  # 5 s without an answer: not past the timeout
    _tick(store, beats[1:], clock)
    lost = beats[1].verdict()
    assert lost is not None and lost.startswith("lost the job's store at 10.0.0.1:29400"), lost
    assert "no heartbeat for 6 s (liveness_timeout_s=5, LOOM_LIVENESS_TIMEOUT_S)" in lost
    assert "rank 0 (node 0, 10.0.0.1)" in lost and "ConnectionError: no answer" in lost


@pytest.mark.unit
@pytest.mark.timeout(20)
def test_the_watchdog_thread_stops_the_process_on_a_lost_peer(monkeypatch):
    store = _Store()
    wd = Watchdog(0, 2, timeout_s=300, store=store, liveness_timeout=0.5)
    assert wd.poll_s == pytest.approx(0.1)  # a fifth of the liveness timeout: several beats per timeout
    store.add(PREFIX + "beat1", 1)  # rank 1 beat once, then went silent
    stopped = threading.Event()
    reports: list[tuple[str, type]] = []

    def stop_process(text: str, error: type) -> None:
        reports.append((text, error))
        stopped.set()
        wd._stop.set()

    monkeypatch.setattr(wd, "_stop_process", stop_process)
    wd._thread = threading.Thread(target=wd._watch, daemon=True)
    wd.enter("gradient all-reduce")
    wd._thread.start()
    assert stopped.wait(15), "no verdict"
    wd._thread.join(5)
    text, error = reports[0]
    assert error.__name__ == "PeerLostError"
    assert text.startswith("loom watchdog: rank 0 (") and "lost rank 1: no heartbeat for" in text, text
    assert "in collective 'gradient all-reduce' #1" in text


@pytest.mark.unit
def test_under_on_worker_failure_continue_a_lost_peer_is_named_and_the_rank_goes_on(monkeypatch, capsys):
    monkeypatch.setenv("LOOM_ON_WORKER_FAILURE", "continue")  # asynchronous training: survivors finish
    wd = Watchdog(0, 2, timeout_s=300, store=_Store(), liveness_timeout=5)
    monkeypatch.setattr(wd, "_stop_process", lambda text, error: pytest.fail(f"stopped: {text}"))
    wd.heartbeat.heard_at = wd.heartbeat.clock() - 6
    lost = wd.heartbeat.verdict()
    assert lost is not None and lost.startswith("lost rank 1: no heartbeat for 6 s")
    wd._lost(lost)
    assert "going on without it (--on-worker-failure continue)" in capsys.readouterr().err
    assert wd.heartbeat.verdict() is None  # said once


@pytest.mark.unit
def test_the_liveness_timeout_comes_from_the_option_or_the_environment(monkeypatch):
    monkeypatch.delenv("LOOM_LIVENESS_TIMEOUT_S", raising=False)
    assert 15 <= liveness_timeout_s() <= 30
    monkeypatch.setenv("LOOM_LIVENESS_TIMEOUT_S", "7.5")
    assert liveness_timeout_s() == 7.5 and liveness_timeout_s(3) == 3
    monkeypatch.setenv("LOOM_LIVENESS_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="LOOM_LIVENESS_TIMEOUT_S='soon'"):
        liveness_timeout_s()
    with pytest.raises(ValueError, match="liveness timeout must be a positive"):
        GuardOptions(liveness_timeout_s=0)


# -- the real case: two hosts, the link cut mid-training ----------------------------------------------------

LOOM = [sys.executable, "-m", "loom.cli"]
WORKER = Path(__file__).parent / "workers" / "launch_partition.py"


class _Output:
    """A node's combined output, read by a thread."""

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


@pytest.mark.system
@pytest.mark.timeout(240)
@pytest.mark.skipif(not can_make_namespaces(), reason="needs root and iproute2 for network namespaces")
@pytest.mark.parametrize("liveness_s, hang_s", [(5, 300), (None, None)], ids=["short-liveness", "defaults"])
def test_a_cut_link_stops_both_hosts_within_the_liveness_timeout_each_naming_the_other(
    tmp_path, liveness_s, hang_s
):
    env = dict(os.environ, LOOM_JOB_SECRET=os.urandom(32).hex())
    for variable, value in (("LOOM_LIVENESS_TIMEOUT_S", liveness_s), ("LOOM_HANG_TIMEOUT_S", hang_s)):
        env.pop(variable, None)
        if value is not None:
            env[variable] = str(value)
    liveness_s, hang_s = liveness_s or DEFAULT_LIVENESS_TIMEOUT_S, hang_s or DEFAULT_TIMEOUT_S
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKER.parent), env.get("PYTHONPATH")]))
    env.pop("GLOO_SOCKET_IFNAME", None)
    port = 29400 + os.getpid() % 500  # the namespaces are fresh: nothing else listens there
    nodes: list[subprocess.Popen] = []
    with bridged_hosts(2, subnet=81) as hosts:
        master = f"{hosts[0].address}:{port}"
        try:
            for node, host in enumerate(hosts):
                cmd = host.command(*LOOM, "run", "-n", "1", "--nnodes", "2", "--node-rank", str(node),
                                   "--master", master, "--run-dir", str(tmp_path / f"node{node}"), str(WORKER))  # fmt: skip
                nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True, start_new_session=True))  # fmt: skip
            outputs = [_Output(p) for p in nodes]
            deadline = time.monotonic() + 120
            while min(o.steps() for o in outputs) < 10:
                assert time.monotonic() < deadline, [o.text()[-2000:] for o in outputs]
                assert all(p.poll() is None for p in nodes), [o.text()[-2000:] for o in outputs]
                time.sleep(0.2)
            subprocess.run(["ip", "-n", hosts[1].name, "link", "set", hosts[1].interface, "down"], check=True)
            cut = time.monotonic()
            ended: list[float | None] = [None, None]
            while None in ended and time.monotonic() - cut < 120:  # below the hang timeout (300 s, 180 s)
                for i, p in enumerate(nodes):
                    if ended[i] is None and p.poll() is not None:
                        ended[i] = time.monotonic() - cut
                time.sleep(0.05)
            assert None not in ended, ([o.text()[-2000:] for o in outputs], ended)
            for o in outputs:
                o.thread.join(timeout=5)
            texts = [o.text() for o in outputs]
        finally:
            for p in nodes:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    print(f"seconds from the cut to each node's exit (liveness {liveness_s:g} s, hang {hang_s:g} s):",
          [round(t or 0, 1) for t in ended])  # fmt: skip
    assert all(p.returncode != 0 for p in nodes), texts
    setting = f"(liveness_timeout_s={liveness_s:g}, LOOM_LIVENESS_TIMEOUT_S)"
    # node 0 keeps the store: it sees rank 1's heartbeats stop; node 1 cannot reach the store at all
    expected = [f"lost rank 1 (node 1, {hosts[1].address}): no heartbeat for",
                f"lost the job's store at {master}"]  # fmt: skip
    for text, lost, other in zip(texts, expected, ["rank 1", "rank 0"], strict=True):
        reported = [line for line in text.splitlines() if line.startswith("loom run:") and lost in line]
        print("\n".join(line for line in text.splitlines() if "loom run:" in line))
        assert reported and setting in reported[0] and other in reported[0], text[-3000:]
        assert "PeerLostError" in reported[0] and "Traceback" not in text, text[-3000:]
    assert f"rank 0 (node 0, {hosts[0].address})" in texts[1], texts[1][-3000:]
