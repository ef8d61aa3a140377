"""Entry point of every process a Ray actor starts: ``python -m loom.ray.rank_main [-m] TARGET ARGS``.

It completes loom's environment with what only the rank's own node knows, then hands over to
`loom.launch.worker` (the entry point of `loom run`'s workers: dies with its actor, records its exception):
``GLOO_SOCKET_IFNAME`` becomes the interface that holds the node's Ray address (``LOOM_RAY_NODE_ADDRESS``), so
gloo listens on the network Ray uses and nowhere else, unless the user chose an interface. Done here, not in
the actor, which never imports loom (`loom.ray.rank_host`).
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    address = os.environ.pop("LOOM_RAY_NODE_ADDRESS", None)
    if address and "GLOO_SOCKET_IFNAME" not in os.environ and sys.platform.startswith("linux"):
        from loom.net.interfaces import interface_of

        interface = interface_of(address)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    from loom.launch.worker import main as worker_main

    worker_main()


if __name__ == "__main__":
    main()
