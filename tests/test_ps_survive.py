"""Parameter servers survive their death (issue 13): checkpoints, the launcher's restarts, the workers' view.

Through `loom run -n 2 --servers 1` (tests/workers/ps_survive_job.py SIGKILLs server 0 mid-training): sync ends
at the parameters of an uninterrupted run (the step in flight is repeated, nothing else); async counts and prints
the updates lost since the server's last checkpoint; a server that dies more often than --max-server-restarts
stops the job naming it and its signal. Without processes: the checkpoint files survive a crash mid-save, a sync
step is on disk before its replies go out, async saves by time. A request to a dead server that nobody restarts
names the death or the unreachable address, never the job secret.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from ps_helpers import parameter_servers
from test_ps_launch import results, run_job
from torch import nn
from workers.common import least_squares

from loom.ps.client import PSClient
from loom.ps.deaths import RECORD_NAME, write_record
from loom.ps.plan import Piece
from loom.ps.server import ParameterServerProcess, ServerConfig
from loom.ps.shard import ModelShard, ShardSettings
from loom.ps.wire import MessageType, encode, secret_from_hex

from conftest import WORKERS  # isort: skip

JOB = WORKERS / "ps_survive_job.py"
RESTART_LINE = re.compile(
    r"loom run: parameter server 0 died \(killed by SIGKILL\); restarting it from its checkpoint \(restart 1 of 3\)"
)


def run_survive(tmp_path: Path, args: list[str], config: dict, timeout: float = 120):
    """`loom run ARGS ps_survive_job.py CONFIG` in its own session: (status, stdout, stderr, processes left)."""
    return run_job(tmp_path, args, config, timeout, JOB)


def one_process_reference(steps: int) -> torch.Tensor:
    """The job's model after ``steps`` sync steps, in one process on the whole global batches (what sync equals)."""
    from loom.data import GlobalBatchSampler

    x, y = least_squares().tensors  # the problem of workers/ps_survive_job.py
    torch.manual_seed(0)
    model = nn.Linear(8, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler, done = GlobalBatchSampler(256, 48, seed=1), 0
    while done < steps:
        for batch in sampler:
            opt.zero_grad()
            nn.functional.mse_loss(model(x[batch.indices]), y[batch.indices]).backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return model.weight.detach().flatten()


@pytest.mark.system
@pytest.mark.timeout(150)
def test_sync_job_survives_a_killed_server_and_ends_where_an_uninterrupted_run_does(tmp_path):
    """The kill lands while rank 0's push of step 5 waits for rank 1's: that step is lost with the server and
    repeated (both resend); every completed step was on disk before its replies (write-ahead)."""
    config = {"mode": "sync", "steps": 12, "slow_s": 0.02, "kill_steps": [5], "in_flight": True}
    status, out, err, left = run_survive(tmp_path, ["-n", "2", "--servers", "1"], config)
    assert status == 0, err[-3000:]
    assert left == []
    assert RESTART_LINE.search(err), err[-3000:]
    assert "2 worker(s), 0 restart(s), 1 parameter-server restart(s), 12 steps;" in err, err[-3000:]
    assert "resumed model 'default' at version 5" in out, out[-3000:]
    done = results(tmp_path)
    reference = one_process_reference(12)
    for rank, result in done.items():
        assert result["clock"] == 12
        # A step applied twice or lost would move the weights by ~1e-2 (lr 0.05); summation order differs by ~1e-7.
        torch.testing.assert_close(torch.tensor(result["weight"]), reference, atol=1e-5, rtol=0)
        (restart,) = result["restarts"]
        assert restart["resumed_version"] == restart["seen_version"] == 5 and restart["lost_updates"] == 0
        assert f"[rank{rank}]: loom: worker rank {rank}: parameter server 0 at " in out
    assert "no update lost" in out
    assert done[0]["weight"] == done[1]["weight"]
    record = json.loads((tmp_path / "run" / RECORD_NAME).read_text())["servers"][0]
    assert [d["status"] for d in record["deaths"]] == [-9] and record["restarts"] == 1
    assert record["state"] == "stopped"  # the SIGTERM at the end of the job is not a death
    downtime = min(r["restarts"][0]["time"] for r in done.values()) - done[0]["kills"][0]
    print(f"sync: server down {downtime:.1f} s (kill to its first answer), 1 step repeated, 0 lost")


@pytest.mark.system
@pytest.mark.timeout(150)
def test_async_job_survives_a_killed_server_and_counts_the_lost_updates(tmp_path):
    """No save by time within the run (interval 60 s): the restarted server is back at INIT's version 0, so every
    update before the kill is lost, and each worker counts those it saw. Under --on-worker-failure continue
    (the launcher's own supervision rather than the elastic agent's)."""
    config = {"mode": "async", "steps": 30, "slow_s": 0.02, "kill_steps": [20], "checkpoint_interval_s": 60}
    args = ["-n", "2", "--servers", "1", "--on-worker-failure", "continue"]
    status, out, err, left = run_survive(tmp_path, args, config)
    assert status == 0, err[-3000:]
    assert left == []
    assert RESTART_LINE.search(err), err[-3000:]
    done = results(tmp_path)
    assert sorted(done) == [0, 1]
    for rank, result in done.items():
        assert result["clock"] == 30
        (restart,) = result["restarts"]
        assert restart["resumed_version"] == 0 and restart["lost_updates"] == restart["seen_version"] >= 20
        line = (f"\\[rank{rank}\\]: loom: worker rank {rank}: parameter server 0 at 127.0.0.1:\\d+ was restarted from "
                f"its checkpoint at version 0 \\(this worker had seen version {restart['seen_version']}\\): "
                f"{restart['lost_updates']} update\\(s\\) lost")  # fmt: skip
        assert re.search(line, out), out[-3000:]
    downtime = min(r["restarts"][0]["time"] for r in done.values()) - done[0]["kills"][0]
    lost = max(r["restarts"][0]["lost_updates"] for r in done.values())
    print(f"async: server down {downtime:.1f} s, {lost} updates lost (no save since INIT)")


@pytest.mark.system
@pytest.mark.timeout(150)
def test_a_server_that_dies_more_often_than_the_limit_stops_the_job(tmp_path):
    config = {"mode": "sync", "steps": 20, "slow_s": 0.02, "kill_steps": [2, 4]}
    args = ["-n", "2", "--servers", "1", "--max-server-restarts", "1"]
    status, out, err, left = run_survive(tmp_path, args, config)
    assert status == 1, err[-3000:]
    assert left == []
    assert (
        "parameter server 0 died (killed by SIGKILL); restarting it from its checkpoint (restart 1 of 1)"
        in err
    )
    assert re.search(r"loom run: parameter server 0 at 127\.0\.0\.1:\d+ died \(killed by SIGKILL\) after 1 "
                     r"restart\(s\), more than --max-server-restarts 1 allows; stopping the job", err), err[-3000:]  # fmt: skip
    assert results(tmp_path) == {}
    record = json.loads((tmp_path / "run" / RECORD_NAME).read_text())["servers"][0]
    assert record["state"] == "dead" and [d["restarted"] for d in record["deaths"]] == [True, False]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_request_to_a_dead_server_names_the_death_not_the_secret(tmp_path, monkeypatch):
    monkeypatch.delenv("LOOM_RUN_DIR", raising=False)
    with parameter_servers(1) as servers:
        client = PSClient(servers.addresses, secret_from_hex(servers.secret))
        try:
            client.hello(timeout_s=30)
            servers.kill(0)  # started without the launcher: nobody restarts it
            with pytest.raises(TimeoutError) as caught:
                client.request(MessageType.STATS, [{"worker": 1}], timeout_s=1.0)
            message = str(caught.value)
            assert message.startswith(f"worker rank 1: parameter server 0 at {servers.addresses[0]} did not "
                                      "answer STATS within 1 s: it is unreachable: nothing accepts connections")  # fmt: skip
            assert "the server process is not running" in message and "SECRET" not in message
            # With the launcher's record (past its restart limit): the death and its signal.
            write_record(tmp_path, [{"index": 0, "address": servers.addresses[0], "pid": 1, "state": "dead",
                                     "restarts": 3, "max_restarts": 3, "deaths": [{"time": time.time(),
                                     "status": -9, "cause": "killed by SIGKILL", "restarted": False}]}])  # fmt: skip
            monkeypatch.setenv("LOOM_RUN_DIR", str(tmp_path))
            with pytest.raises(TimeoutError, match=r"parameter server 0 at \S+ did not answer PULL within 1 s: it "
                               r"died at \d\d:\d\d:\d\d \(killed by SIGKILL\) and was not restarted: it died 1 "
                               r"time\(s\), more than the launcher's --max-server-restarts 3"):  # fmt: skip
                client.request(MessageType.PULL, [{"worker": 0}], timeout_s=1.0)
        finally:
            client.close()


# -- without processes -----------------------------------------------------------------------------------------
SECRET = bytes(range(32))
PIECES = [Piece(0, "w", 0, 3, 1, False, 0, 0)]


def settings(mode: str, every: int, interval: float) -> dict:
    return {"mode": mode, "staleness": 0, "num_workers": 2, "timeout_s": 30.0, "checkpoint_every": every,
            "optimizer": "SGD", "groups": [{"lr": 0.1}], "checkpoint_interval_s": interval}  # fmt: skip


class _Part:
    def __init__(self, data: bytes) -> None:
        self.bytes, self.buffer = data, memoryview(data)


class Server:
    """A server with a checkpoint folder, driven by decoded frames; each reply records the version on disk."""

    def __init__(self, folder: Path, mode: str, every: int, interval: float) -> None:
        self.process = ParameterServerProcess(ServerConfig(checkpoint_dir=folder), SECRET)
        self.folder, self.settings, self.seqs = (
            folder / "server0",
            settings(mode, every, interval),
            {0: 0, 1: 0},
        )
        self.on_disk_at_reply: list[tuple[int, int | None]] = []
        self.process._reply = self._record  # type: ignore[method-assign]
        for worker in (0, 1):
            self.send(MessageType.HELLO, worker, epoch=0)

    def _record(self, identity, frame, meta, tensors=None) -> None:
        path = self.folder / "m.json"
        on_disk = json.loads(path.read_text())["version"] if path.exists() else None
        self.on_disk_at_reply.append((meta.get("version", -1), on_disk))

    def send(self, kind, worker: int, meta=None, tensors=None, epoch=None) -> None:
        self.seqs[worker] += 1
        base = {
            "ns": "m",
            "worker": worker,
            "settings": self.settings,
            "pieces": [p.to_json() for p in PIECES],
        }
        data = encode(SECRET, kind, epoch=self.process.epoch if epoch is None else epoch, session=1 + worker,
                      seq=self.seqs[worker], meta={**base, **(meta or {})}, tensors=tensors)  # fmt: skip
        self.process.handle([_Part(b"w%d" % worker), _Part(data)])

    def push(self, worker: int, clock: int) -> None:
        self.send(MessageType.PUSH, worker, {"clock": clock, "version": 0}, {"g0": torch.ones(3)})


@pytest.mark.unit
def test_a_sync_step_is_on_disk_before_its_replies_go_out(tmp_path):
    server = Server(tmp_path, "sync", 1, 0.0)
    try:
        server.send(MessageType.INIT, 0, tensors={"p0": torch.zeros(3)})
        assert server.on_disk_at_reply[-1] == (0, 0)  # INIT saved the model before answering
        for clock in range(3):
            server.push(0, clock)
            server.push(1, clock)
        pushes = server.on_disk_at_reply[-6:]
        assert pushes == [(v, v) for v in (1, 1, 2, 2, 3, 3)]
        assert ModelShard.load(server.folder / "m.json").version == 3
    finally:
        server.process.close()


@pytest.mark.unit
def test_async_saves_by_time_and_not_on_every_update(tmp_path):
    server = Server(tmp_path, "async", 0, 0.2)
    try:
        server.send(MessageType.INIT, 0, tensors={"p0": torch.zeros(3)})
        for clock in range(5):
            server.push(0, clock)
        assert all(on_disk == 0 for _, on_disk in server.on_disk_at_reply[-5:])  # within 0.2 s: not saved
        deadline = time.monotonic() + 10  # due 0.2 s after the first update (or 20x the INIT save's time)
        while ModelShard.load(server.folder / "m.json").version != 5 and time.monotonic() < deadline:
            time.sleep(0.05)
            server.process._tick(time.monotonic())  # the idle loop saves what is due
        assert ModelShard.load(server.folder / "m.json").version == 5
    finally:
        server.process.close()


@pytest.mark.unit
@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), "safetensors"])
def test_a_save_that_fails_is_logged_and_training_goes_on(tmp_path, monkeypatch, capsys, error):
    """A full disk (safetensors reports it as its own SafetensorError, not OSError) must not end the server."""
    import safetensors

    from loom.ps import shard as shard_module

    def failing_save(*args, **kwargs):
        raise error if isinstance(error, OSError) else safetensors.SafetensorError("No space left on device")

    server = Server(tmp_path, "sync", 1, 0.0)
    try:
        monkeypatch.setattr(shard_module, "save_file", failing_save)
        server.send(MessageType.INIT, 0, tensors={"p0": torch.zeros(3)})
        server.push(0, 0)
        server.push(1, 0)
        assert server.process.models["m"].version == 1  # the step was applied and answered
        assert "could not save its checkpoint" in capsys.readouterr().out
        monkeypatch.undo()
        server.push(0, 1)
        server.push(1, 1)
        assert ModelShard.load(server.folder / "m.json").version == 2
        assert "saving works again" in capsys.readouterr().out
    finally:
        server.process.close()


def make_shard(value: float, version: int) -> ModelShard:
    shard = ModelShard("m", ShardSettings(**settings("sync", 1, 0.0)), PIECES, {0: torch.full((3,), value)})
    shard.version = version
    return shard


@pytest.mark.unit
@pytest.mark.parametrize("crash_at", [1, 2])
def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, crash_at):
    """Crash at the tensors' rename (1) or at the JSON's (2), saving the same version with other values (as a
    RESTORE, then a save, can): the JSON and the tensors it names still belong together."""
    make_shard(1.0, 4).save(tmp_path)
    calls = {"n": 0}
    real_replace = os.replace

    def crashing_replace(src, dst):
        calls["n"] += 1
        if calls["n"] == crash_at:
            raise KeyboardInterrupt("killed mid-save")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(KeyboardInterrupt):
        make_shard(2.0, 4).save(tmp_path)
    monkeypatch.setattr(os, "replace", real_replace)
    loaded = ModelShard.load(tmp_path / "m.json")
    assert loaded.version == 4 and loaded.params[0].detach().tolist() == [1.0, 1.0, 1.0]
    assert loaded.resumed_version == 4
    make_shard(3.0, 5).save(tmp_path)  # the next save cleans up what the crash left
    assert sorted(p.name for p in tmp_path.iterdir())[0] == "m.json" and len(list(tmp_path.iterdir())) == 2


@pytest.mark.unit
def test_a_checkpoint_that_does_not_load_is_named(tmp_path):
    make_shard(1.0, 2).save(tmp_path)
    meta = json.loads((tmp_path / "m.json").read_text())
    (tmp_path / meta["weights"]).write_bytes(b"not safetensors")
    with pytest.raises(
        ValueError, match=r"m\.json is not a loadable parameter-server checkpoint.*HINT: delete"
    ):
        ModelShard.load(tmp_path / "m.json")


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_supervised_workers_are_stopped_when_the_server_watcher_gives_up(tmp_path, monkeypatch, capsys):
    """--on-worker-failure continue: the launcher's own loop stops the workers and returns 1 once the servers'
    watcher reports a failure (here after 1 s; the workers would sleep 60 s)."""
    from loom.launch.supervise import supervise_workers

    monkeypatch.setenv("LOOM_JOB_SECRET", os.urandom(32).hex())
    started = time.monotonic()
    status = supervise_workers(
        2, ["-c", "import time; time.sleep(60)"], "t", tmp_path, 5.0,
        lambda: "server 0 gone" if time.monotonic() - started > 1.0 else None,
    )  # fmt: skip
    # Stopped, not waited for: the workers would sleep 60 s (a bound far from what load can stretch 1 s to).
    assert status == 1 and time.monotonic() - started < 50
    assert "stopped by signal" not in capsys.readouterr().err


@pytest.mark.unit
def test_an_ssp_server_restarted_behind_its_workers_learns_their_clocks_from_their_pulls(tmp_path):
    """Saved at clocks (1, 1); the workers went on to clock 4 before the server died. Their pulls at clock 4
    (staleness 1) must be granted by the restarted server, not held back waiting for pushes lost with it."""
    first = Server(tmp_path, "ssp", 0, 0.0)
    first.send(MessageType.INIT, 0, tensors={"p0": torch.zeros(3)})
    first.send(MessageType.INIT, 1, tensors={"p0": torch.zeros(3)})
    first.push(0, 0)
    first.push(1, 0)
    first.process.checkpoint()
    first.process.close()
    restarted = Server(tmp_path, "ssp", 0, 0.0)
    try:
        assert restarted.process.models["m"].clocks.clocks == [1, 1]
        for worker in (0, 1):
            restarted.send(MessageType.PULL, worker, {"clock": 4})
        assert len(restarted.on_disk_at_reply) == 4 and not restarted.process.parked_pulls.get(
            "m"
        )  # 2 HELLOs, 2 PULLs
        restarted.push(0, 4)  # and a push at the worker's clock is applied, not taken for a resent one
        assert restarted.process.models["m"].version == 3
    finally:
        restarted.process.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_dead_servers_port_stays_taken_until_its_restart_answers(tmp_path, monkeypatch):
    """The launcher holds each server's listening socket: while a killed server is being restarted no other
    process can listen on its port (and take a worker's connection token from its handshake), and the
    restarted server answers on it."""
    import socket

    from loom.launch.servers import ServerGroup

    secret = os.urandom(32)
    monkeypatch.setenv("LOOM_JOB_SECRET", secret.hex())
    monkeypatch.setenv("LOOM_RUN_DIR", str(tmp_path))
    group = ServerGroup(1, "127.0.0.1", 1, tmp_path, on_failure=lambda: None)
    group.start()
    client = PSClient(group.addresses, secret)
    try:
        client.hello(timeout_s=60)
        port = int(group.addresses[0].rsplit(":", 1)[1])
        group.servers[0].proc.kill()
        for _ in range(20):  # the seconds before the restarted server listens
            with socket.socket() as squatter, pytest.raises(OSError, match="in use"):
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old connections
                squatter.bind(("127.0.0.1", port))
            time.sleep(0.05)
        answer = client.request(MessageType.STATS, [{}], timeout_s=60)[0]
        assert answer.meta["index"] == 0 and group.restarts == 1
    finally:
        client.close()
        group.stop()
