"""Mesh plans with model chunks in the search (issue 28, part 4; tier 1): behind
``TuneOptions.mesh_chunks`` (``tune --mesh-chunks``) they compete with the uniform plans and the
mesh plans without chunks; the winner is the fastest; they are never searched by default (no
runtime runs them yet), and a chunked winner is written with the note that ``validate``
refuses it."""

from __future__ import annotations

import pytest

from megatron_hetero import cli
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.models import load_model
from megatron_hetero.plan import load_any_plan
from megatron_hetero.sim.step import simulate
from megatron_hetero.tuner import TuneOptions, tune
from megatron_hetero.tuner.problem import Problem

GROUPS = [("A100-SXM-80GB", 1, 8), ("T4-16GB", 4, 4)]
INV = inventory_from_data({"groups": [{"gpu": g, "nodes": n, "gpus_per_node": w}
                                      for g, n, w in GROUPS]}, source="inv.yaml")
MODEL = load_model("llama2-13b", seq_length=4096)


@pytest.fixture(scope="module")
def searched():
    return tune(MODEL, INV, 512, options=TuneOptions(meshes=True, mesh_chunks=True))


def test_chunked_mesh_plans_compete_with_the_others(searched):
    r = searched
    plan, sim = r.chunked_mesh_plan, r.chunked_mesh_sim
    assert plan is not None and plan.interleaved_chain and plan.format_version == 2
    assert len({m.tensor_model_parallel_size for m in plan.meshes}) > 1 or \
        len({m.data_parallel_size for m in plan.meshes}) > 1
    problem = Problem(MODEL, INV, 512, {}, TuneOptions())
    again = simulate(plan, problem.cost(plan.precision), record_events=False)
    assert again.step_time_s == pytest.approx(sim.step_time_s, rel=1e-12) and again.fits_memory
    steps = [r.sim.step_time_s, r.mesh_sim.step_time_s, sim.step_time_s]
    assert r.best[1].step_time_s == min(steps)
    assert r.mesh_wins == (r.best[0] is not r.plan)
    assert not r.mesh_plan.interleaved_chain


def test_no_chunked_mesh_plan_by_default():
    r = tune(MODEL, INV, 512, options=TuneOptions(meshes=True))
    assert r.chunked_mesh_plan is None and not r.best[0].interleaved_chain


def test_tune_mesh_chunks_writes_a_winner_validate_takes(tmp_path, capsys, searched):
    inv = tmp_path / "inv.yaml"
    inv.write_text("groups:\n" + "".join(f"  - {{gpu: {g}, nodes: {n}, gpus_per_node: {w}}}\n"
                                         for g, n, w in GROUPS))
    out = tmp_path / "plan.yaml"
    assert cli.main(["tune", str(inv), "--model", "llama2-13b", "--seq-length",
                     "4096", "--global-batch-size", "512", "--mesh-chunks", "-q",
                     "-o", str(out)]) == 0
    plan = load_any_plan(out)
    assert plan.interleaved_chain == searched.best[0].interleaved_chain
    text = capsys.readouterr().out
    # the summary names the chunks, and the release that runs mesh plans, chunked or not
    if plan.interleaved_chain:
        assert (f"interleaved across the meshes, {plan.virtual_pipeline_size} model chunks a "
                f"stage") in text, text
    else:
        assert "interleaved" not in text.split("\n")[0], text
    assert "megatron-core 0.17 or later" in text, text
    assert cli.main(["validate", str(out)]) == 0
