"""The Llama-2 examples validate against their inventories and are current: regenerating them
with scripts/gen_examples.py gives the committed files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hetero.hardware.inventory import load_inventory
from megatron_hetero.plan.megatron_args import megatron_args_line
from megatron_hetero.plan import load_plan
from megatron_hetero.placement.inventory import check_against_inventory

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"7b": "llama2-7b", "13b": "llama2-13b", "70b": "llama2-70b"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_validates_against_its_inventory(name):
    d = REPO / "examples" / "llama2" / name
    for f in ("inventory.yaml", "plan.yaml", "megatron_args.txt", "launch.sh", "README.md"):
        assert (d / f).is_file(), f"{d / f} missing"
    inv = load_inventory(d / "inventory.yaml")
    plan = load_plan(d / "plan.yaml", catalog=inv.catalog)
    check_against_inventory(plan, inv, source=str(d / "plan.yaml"))
    assert plan.model.name == EXAMPLES[name]
    assert len(plan.device_counts()) >= 2, "an example plan should use the mixed pool"
    rel = f"examples/llama2/{name}/plan.yaml"
    assert (d / "megatron_args.txt").read_text().strip() == megatron_args_line(plan, rel)
    assert "launch.sh" in (d / "README.md").read_text()


def test_examples_are_current():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_examples.py"), "--check"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, f"stale examples:\n{proc.stdout[-3000:]}\n{proc.stderr}"
