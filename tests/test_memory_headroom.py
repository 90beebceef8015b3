"""Issue 32 A.1 and A.3: each card's memory as the device reports it, less a memory headroom
(``--memory-headroom`` on tune, replan, simulate and validate), and validate's memory check
without an inventory."""

from __future__ import annotations

import math

import pytest

from megatron_hetero.cli import main
from megatron_hetero.cost import CostModel
from megatron_hetero.cost.model import DEFAULT_MEMORY_HEADROOM
from megatron_hetero.errors import HeteroError, SchemaError
from megatron_hetero.hardware.catalog import DRIVER_SHARE, load_catalog
from megatron_hetero.hardware.inventory import inventory_from_data
from megatron_hetero.models import model_preset
from megatron_hetero.plan import load_any_plan

from .conftest import REPO

PLAN = REPO / "tests/data/plan_a100_v100.yaml"
TIGHT = "groups:\n  - {gpu: RTX4090-24GB, nodes: 1, gpus_per_node: 4}\n"
TUNE = ["--model", "llama2-7b", "--global-batch-size", "16", "--seq-length", "1024", "-q"]


def test_capacity_is_what_the_device_reports():
    catalog = load_catalog()
    # measured on the H200 of docs/gpu.md
    assert catalog.get("H200-SXM-141GB").visible_memory_bytes == pytest.approx(139.8 * 2**30)
    # no measurement: the size as sold read in GiB, less the driver's share
    a100 = catalog.get("A100-SXM-80GB")
    assert a100.visible_memory_gib is None
    assert a100.visible_memory_bytes == pytest.approx(80 * 2**30 * (1 - DRIVER_SHARE))
    assert a100.visible_memory_bytes > a100.memory_bytes  # no longer decimal GB by accident


def test_cost_model_keeps_the_headroom_free():
    inv = inventory_from_data({"groups": [{"gpu": "H200", "nodes": 1, "gpus_per_node": 1}]})
    model = model_preset("llama2-7b")
    assert CostModel(model, inv).capacity("H200-SXM-141GB") == pytest.approx(
        139.8 * 2**30 * (1 - DEFAULT_MEMORY_HEADROOM))
    assert CostModel(model, inv, memory_headroom=0.25).capacity("H200-SXM-141GB") == pytest.approx(
        139.8 * 2**30 * 0.75)
    assert CostModel(model, inv, memory_headroom=0).capacity("H200-SXM-141GB") == pytest.approx(
        139.8 * 2**30)
    for bad in (-0.1, 1.0, 2, math.nan, math.inf):
        with pytest.raises(HeteroError, match="memory_headroom"):
            CostModel(model, inv, memory_headroom=bad)


def test_inventory_gives_visible_memory(tmp_path):
    inv = inventory_from_data({"groups": [{"gpu": "T4-16GB", "nodes": 1, "gpus_per_node": 1}],
                               "gpus": {"T4-16GB": {"visible_memory_gib": 14.6}}})
    assert inv.spec("T4-16GB").visible_memory_bytes == pytest.approx(14.6 * 2**30)
    for bad in (0, -1, 16.5):
        with pytest.raises(SchemaError, match=r"gpus\.T4-16GB.*visible_memory_gib"):
            inventory_from_data({"groups": [{"gpu": "T4-16GB", "nodes": 1, "gpus_per_node": 1}],
                                 "gpus": {"T4-16GB": {"visible_memory_gib": bad}}})


def _peak_fraction(plan_path, inv_path, headroom: float = 0.0) -> float:
    """The largest predicted stage peak of a plan over its card's reported memory."""
    from megatron_hetero.hardware.inventory import load_inventory
    from megatron_hetero.sim.step import simulate

    inv = load_inventory(inv_path)
    plan = load_any_plan(plan_path, catalog=inv.catalog)
    cost = CostModel(plan.model, inv, precision=plan.precision, memory_headroom=headroom)
    sim = simulate(plan, cost, record_events=False)
    return max(s.memory.total / inv.spec(s.device_type).visible_memory_bytes for s in sim.stages)


def test_headroom_is_honoured(tmp_path, capsys):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(TIGHT)
    full, kept = tmp_path / "full.yaml", tmp_path / "kept.yaml"
    assert main(["tune", str(inv), *TUNE, "-o", str(full), "--memory-headroom", "0"]) == 0
    assert main(["tune", str(inv), *TUNE, "-o", str(kept), "--memory-headroom", "0.15"]) == 0
    capsys.readouterr()
    # at no headroom the search fills the card beyond 85%; at 15% every stage stays under 85%
    assert _peak_fraction(full, inv) > 0.85
    assert _peak_fraction(kept, inv) <= 0.85
    assert full.read_text() != kept.read_text()
    # the plan that fits at 0 is refused at 0.15 by validate and simulate, naming the flag
    assert main(["validate", str(full), "--inventory", str(inv), "--memory-headroom", "0"]) == 0
    assert main(["validate", str(full), "--inventory", str(inv), "--memory-headroom", "0.15"]) == 1
    err = capsys.readouterr().err
    assert "stages[0]" in err and "--memory-headroom 0.15" in err and err.count("\n") == 1
    assert main(["simulate", str(full), "--inventory", str(inv), "--memory-headroom", "0.15"]) == 1
    assert "--memory-headroom 0.15" in capsys.readouterr().err
    # the default is the documented one
    assert main(["simulate", str(kept), "--inventory", str(inv)]) == 0
    assert (f"usable memory is {100 * (1 - DEFAULT_MEMORY_HEADROOM):g}% of what the device "
            f"reports (--memory-headroom {DEFAULT_MEMORY_HEADROOM:g})") in capsys.readouterr().out


@pytest.mark.parametrize("command", ["tune", "validate", "simulate"])
@pytest.mark.parametrize("value", ["-0.1", "1", "1.5", "nan", "inf"])
def test_bad_headroom_refused_naming_the_flag(tmp_path, capsys, command, value):
    inv = tmp_path / "inventory.yaml"
    inv.write_text(TIGHT)
    out = tmp_path / "plan.yaml"
    argv = {"tune": ["tune", str(inv), *TUNE, "-o", str(out)],
            "validate": ["validate", str(PLAN)],
            "simulate": ["simulate", str(PLAN), "--inventory", str(inv)]}[command]
    assert main([*argv, f"--memory-headroom={value}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-hetero {command}: error: --memory-headroom: ")
    assert "expected the fraction" in err and err.count("\n") == 1
    assert not out.exists()


def test_validate_checks_memory_without_inventory(tmp_path, capsys):
    # the README's hand-written plan: its V100 stage needs 44.2 GB, the catalog knows the card
    assert main(["validate", str(PLAN)]) == 1
    err = capsys.readouterr().err
    assert "stage 1 (V100-SXM2-32GB, layers 14-31) needs 44.2 GB of 30.6" in err
    assert err.count("\n") == 1
    assert main(["validate", str(PLAN), "--no-memory-check"]) == 0
    assert "valid plan" in capsys.readouterr().out
    # a custom card the plan itself carries is known too: make the V100 big enough
    text = PLAN.read_text()
    big = tmp_path / "big.yaml"
    big.write_text(text.replace("V100-SXM2-32GB", "BigV100") + _custom_gpu("BigV100", 64))
    assert main(["validate", str(big)]) == 0, capsys.readouterr().err
    small = tmp_path / "small.yaml"
    small.write_text(text.replace("V100-SXM2-32GB", "BigV100") + _custom_gpu("BigV100", 40))
    assert main(["validate", str(small)]) == 1
    assert "BigV100" in capsys.readouterr().err


def _custom_gpu(name: str, memory_gb: int) -> str:
    return (f"gpus:\n  {name}:\n    vendor: NVIDIA\n    bf16_tflops: 125\n    bf16: false\n"
            f"    fp32_tflops: 15.7\n    memory_gb: {memory_gb}\n    memory_bandwidth_gb_s: 900\n"
            "    intra_node_link: NVLink2\n    intra_node_bandwidth_gb_s: 150\n"
            "    efficiency: 0.4\n")
