"""The tuner's and the simulator's behaviour on the quick scenarios and the examples is the
stored one: ``scripts/check_behaviour.py --quick`` prints tests/data/behaviour_quick.txt
(tuned and baseline plans, step times, each stage's timings and memory, simulation counts).
A refactoring that means to change nothing must leave it identical; a change of behaviour
regenerates it, on purpose, with the command in the failure message."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys

from .conftest import REPO

REFERENCE = REPO / "tests" / "data" / "behaviour_quick.txt"
REGENERATE = ("python scripts/check_behaviour.py --quick --write-reference "
              "tests/data/behaviour_quick.txt")


def test_behaviour_quick_matches_reference():
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_HETERO_TREE"}  # this tree's package
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "check_behaviour.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = REFERENCE.read_text()
    if proc.stdout != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), proc.stdout.splitlines(True),
                                            str(REFERENCE.relative_to(REPO)), "this tree", n=1))
        if len(diff) > 12000:
            diff = diff[:12000] + "\n... (diff cut; run the script to see all of it)\n"
        raise AssertionError(
            "the tuner's or the simulator's behaviour changed (plans, step times, stage memory or "
            "simulation counts):\n" + diff + "\nIf the change is intended, regenerate the "
            f"reference and commit it with the change:\n    {REGENERATE}\n"
            "(python scripts/check_behaviour.py --against REV shows the same diff against any "
            "revision; add --exact for every float's repr.)")
