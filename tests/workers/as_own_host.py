"""Run the worker script given as argv[1] pretending that this rank is alone on its host (its own LOOM_HOST_ID).

Run by tests/test_comm_shm_channel.py.
"""

import os
import runpy
import sys

os.environ["LOOM_HOST_ID"] = f"pretend-host-{os.environ['RANK']}"
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
