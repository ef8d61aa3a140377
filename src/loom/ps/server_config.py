"""How one parameter-server process (`loom.ps.server`) runs: `ServerConfig`, and its command line."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from loom.ps.wire import WireLimits

__all__ = ["ServerConfig", "default_checkpoint_dir", "parse_args"]


@dataclass(frozen=True)
class ServerConfig:
    """How one server process runs."""

    index: int = 0
    """This server's index among ``num_servers``."""
    num_servers: int = 1
    bind: str = "127.0.0.1:0"
    """``HOST:PORT`` to listen on; loopback unless an interface is named explicitly."""
    checkpoint_dir: Path | None = None
    """Where this server's shards are saved (a ``server<index>`` folder inside it); None: no checkpoints."""
    limits: WireLimits = field(default_factory=WireLimits)
    listen_fd: int | None = None
    """A listening TCP socket's file descriptor, already bound to ``bind``, to accept on instead of binding: the
    launcher keeps the port across a restart of this server, so no other process can take it meanwhile."""
    poll_ms: int = 50
    """How often parked requests and worker timeouts are re-examined when no message arrives."""

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.num_servers:
            raise ValueError(f"--index {self.index} is outside 0..{self.num_servers - 1}")
        host, _, port = self.bind.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--bind must be HOST:PORT, got {self.bind!r}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loom.ps.server", description="A parameter-server process.")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--num-servers", type=int, default=1)
    p.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT (default: loopback, a free port)")
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument(
        "--listen-fd", type=int, default=None, help="a listening socket bound to --bind (loom run's)"
    )
    p.add_argument("--max-payload-mb", type=float, default=256.0, help="largest tensor payload accepted")
    return p.parse_args(argv)


def default_checkpoint_dir() -> Path | None:
    """Without ``--checkpoint-dir``: ``$LOOM_PS_CHECKPOINT_DIR``, else ``$LOOM_RUN_DIR/ps`` (``loom run`` sets it)."""
    if os.environ.get("LOOM_PS_CHECKPOINT_DIR"):
        return Path(os.environ["LOOM_PS_CHECKPOINT_DIR"])
    if os.environ.get("LOOM_RUN_DIR"):
        return Path(os.environ["LOOM_RUN_DIR"]) / "ps"
    return None
