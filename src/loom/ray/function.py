"""Run one rank of a `loom.ray.run` function: ``python -m loom.ray.rank_main -m loom.ray.function``.

The function, its arguments and keyword arguments arrive on stdin, pickled by cloudpickle (Ray's own
serializer: Ray already sent them to the rank's actor this way, inside Ray's authenticated channel; the actor
hands them to this process over a pipe, never a socket or a file). The return value goes back the same way, on
the pipe whose descriptor is in ``LOOM_RAY_RESULT_FD``. Nothing else is unpickled: this process trusts exactly
what its own actor trusts.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    from ray import cloudpickle

    fn, args, kwargs = cloudpickle.loads(sys.stdin.buffer.read())
    result = fn(*args, **kwargs)
    data = cloudpickle.dumps(result)
    with os.fdopen(int(os.environ["LOOM_RAY_RESULT_FD"]), "wb") as out:
        out.write(data)


if __name__ == "__main__":
    main()
