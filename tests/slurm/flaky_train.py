"""A test hook for the node-loss mode: a training script that loses a node the first time.

Run as ``python flaky_train.py <megatron args>`` (under ``python -m megatron_hetero.launch``).
While the file ``$FLAKY_MARKER`` does not exist (the first job), every rank adds
``--exit-interval $FLAKY_EXIT_INTERVAL`` (Megatron saves a checkpoint there and stops), and
after training the ranks on node ``$FLAKY_NODE`` create the marker, take their node out as
a health check would (``scontrol update ... state=$FLAKY_STATE``: ``drain``, the default, or
``down``; ``none``: left as it is) and exit 3: a job step that fails on one node. Later jobs
train as asked. ``$FLAKY_SCRIPT`` is the training script to run (none: no training).
"""

import os
import runpy
import subprocess
import sys
from pathlib import Path

marker = Path(os.environ["FLAKY_MARKER"])
first = not marker.exists()
script = os.environ.get("FLAKY_SCRIPT")
if script:
    extra = ["--exit-interval", os.environ.get("FLAKY_EXIT_INTERVAL", "2")] if first else []
    sys.argv = [script, *sys.argv[1:], *extra]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
node = os.environ.get("SLURMD_NODENAME", "")
if first and node == os.environ["FLAKY_NODE"]:
    marker.write_text(node)
    state = os.environ.get("FLAKY_STATE", "drain")
    if state != "none":
        subprocess.run(["scontrol", "update", f"nodename={node}", f"state={state}",
                        "reason=megatron-hetero test: simulated node loss"], check=True)
    print(f"flaky: rank {os.environ.get('RANK')} on {node} fails", flush=True)
    sys.exit(3)
