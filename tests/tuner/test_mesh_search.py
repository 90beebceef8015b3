"""The mesh search (tier 1): its space respects every type's node, mesh plans compete with the
uniform-TP plans and win only where strictly faster, and ``tune`` writes the winner."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_hetero import cli
from megatron_hetero.cost.model import CostModel
from megatron_hetero.hardware import inventory_from_data
from megatron_hetero.models import load_model
from megatron_hetero.plan import load_any_plan
from megatron_hetero.placement.inventory import check_against_inventory
from megatron_hetero.sim.step import simulate
from megatron_hetero.tuner import TuneOptions, tune
from megatron_hetero.tuner.meshes import MeshSearch, _estimate, _MeshShape
from megatron_hetero.tuner.problem import Problem
from megatron_hetero.tuner.tables import StageTables


def _inventory(groups):
    return inventory_from_data({"groups": [{"gpu": g, "nodes": n, "gpus_per_node": w}
                                           for g, n, w in groups]}, source="inv.yaml")


A100_T4 = [("A100-SXM-80GB", 1, 8), ("T4-16GB", 4, 4)]


def test_layouts_keep_tp_inside_each_types_node_and_use_every_gpu():
    inv = _inventory([("RTX3090-24GB", 2, 8), ("T4-16GB", 4, 4)])
    problem = Problem(load_model("llama2-7b", seq_length=2048), inv, 128, {}, TuneOptions())
    layouts = MeshSearch(problem, StageTables(problem)).layouts()
    assert layouts
    tps = {t: set() for t in ("RTX3090-24GB", "T4-16GB")}
    for chain in layouts:
        assert sorted(c[0] for c in chain) == ["RTX3090-24GB", "T4-16GB"]
        for gpu, tp, pp, dp, ep in chain:  # EP: 1 for a dense model
            assert ep == 1
            assert tp * pp * dp == 16
            tps[gpu].add(tp)
        dps = [c[3] for c in chain]
        assert all(max(a, b) % min(a, b) == 0 for a, b in zip(dps, dps[1:]))
    assert tps == {"RTX3090-24GB": {1, 2, 4, 8}, "T4-16GB": {1, 2, 4}}


@pytest.mark.parametrize("groups, model, gbs", [
    ([("RTX3090-24GB", 2, 8), ("T4-16GB", 4, 4)], "llama2-7b", 128),
    (A100_T4, "llama2-13b", 256),
])
def test_each_candidates_bound_is_below_its_estimate(groups, model, gbs):
    # the search visits candidates in order of their bound and stops once it passes the kept
    # estimates: for every chain and micro-batch, at every chunk count, the estimate (when one
    # fits) is at least (m + (P - 1) / v) times the bound's slowest stage
    problem = Problem(load_model(model, seq_length=2048), _inventory(groups), gbs, {},
                      TuneOptions(meshes=True, mesh_chunks=True))
    search = MeshSearch(problem, StageTables(problem))
    L, checked = problem.model.num_layers, 0
    for i, (fractions, chain, batch, m, P, _) in enumerate(search.pairs()):
        bound = search.bound(i)
        assert bound >= fractions
        shapes = [_MeshShape(device_type=t, tp=tp, pp=pp, dp=dp, mbs=batch // dp, ep=ep)
                  for t, tp, pp, dp, ep in chain]
        for v in (1, 2, 4):
            if L < P * v:
                continue
            got = search.evaluate(shapes, m, v, build=False)
            if got is not None:
                assert got[0] >= (m + (P - 1) / v) * bound
                checked += 1
    assert checked > 20


def test_a_mesh_plan_wins_where_it_is_strictly_faster():
    """Llama-2 13B, GBS 512 on 8 A100 + 16 T4 (4-GPU nodes): the best mesh plan gives the T4s
    and the A100s different TP sizes and beats every uniform-TP plan; it validates against the
    pool and simulates to the figure the search reports. (At GBS 256 the uniform plan wins
    since it interleaves in micro-batch groups of 4: 3 stages do not divide 64 micro-batches.)"""
    inv = _inventory(A100_T4)
    model = load_model("llama2-13b", seq_length=4096)
    r = tune(model, inv, 512, options=TuneOptions(meshes=True))
    assert r.mesh_wins
    plan, sim = r.best
    assert not plan.one_grid and sim is r.mesh_sim
    assert sim.step_time_s < r.sim.step_time_s
    assert len({m.tensor_model_parallel_size for m in plan.meshes}) > 1
    check_against_inventory(plan, inv, source="tuned")
    again = simulate(plan, CostModel(model, inv, precision=plan.precision))
    assert again.step_time_s == pytest.approx(sim.step_time_s, rel=1e-12)
    assert plan.prediction["uniform_step_time_s"] == pytest.approx(r.sim.step_time_s, abs=1e-6)
    off = tune(model, inv, 512)  # mesh search is opt-in: the runtime refuses mesh plans yet
    assert off.mesh_plan is None and not off.mesh_wins
    assert off.plan.to_data() == r.plan.to_data()  # the uniform-TP search is untouched


def test_uniform_plan_kept_where_no_mesh_plan_is_faster():
    inv = _inventory([("RTX3090-24GB", 2, 8), ("T4-16GB", 4, 4)])
    r = tune(load_model("llama2-7b", seq_length=2048), inv, 128,
             options=TuneOptions(meshes=True))
    assert r.mesh_plan is not None and not r.mesh_wins
    assert r.best == (r.plan, r.sim)
    assert r.mesh_sim.step_time_s >= r.sim.step_time_s


def test_no_mesh_search_on_one_device_type():
    r = tune(load_model("llama2-7b", seq_length=2048), _inventory([("A100-SXM-80GB", 1, 8)]), 64,
             options=TuneOptions(meshes=True))
    assert r.mesh_plan is None and r.best == (r.plan, r.sim)


def test_tune_command_writes_the_winning_mesh_plan(tmp_path, capsys):
    inv = tmp_path / "inv.yaml"
    inv.write_text("groups:\n  - {gpu: A100-SXM-80GB, nodes: 1, gpus_per_node: 8}\n"
                   "  - {gpu: T4-16GB, nodes: 4, gpus_per_node: 4}\n")
    out = tmp_path / "plan.yaml"
    assert cli.main(["tune", str(inv), "--model", "llama2-13b", "--seq-length",
                     "4096", "--global-batch-size", "512", "--output", str(out), "--quiet",
                     "--meshes", "--timeline", str(tmp_path / "t.png"),
                     "--report", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "tuned   : mesh plan" in text and "speedup over the uniform-TP plan" in text
    assert load_any_plan(out).format_version == 2
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["mesh_plan"]["speedup_over_uniform"] > 1
    assert (tmp_path / "t.png").stat().st_size > 10_000
    assert cli.main(["validate", str(out), "--inventory", str(inv)]) == 0


def test_no_mesh_plan_for_a_model_with_tied_embeddings():
    """A mesh plan of several stages cannot tie the output layer to the embedding (the schema
    refuses it), so the mesh search offers none for such a model; the uniform plan stands."""
    import dataclasses

    inv = _inventory(A100_T4)
    model = dataclasses.replace(load_model("llama2-13b", seq_length=4096),
                                untie_embeddings_and_output_weights=False)
    r = tune(model, inv, 512, options=TuneOptions(meshes=True))
    assert r.mesh_plan is None and not r.mesh_wins
    assert r.best[0] is r.plan


def test_no_mesh_plan_across_vendors():
    """On A100s beside MI300Xs the mesh search offers nothing (its bridges would join NCCL and
    RCCL ranks), so ``tune --meshes`` keeps the format-1 plan with host-staged edges."""
    inv = _inventory([("A100-SXM-80GB", 2, 8), ("MI300X-192GB", 1, 8)])
    r = tune(load_model("llama2-13b", seq_length=4096), inv, 256,
             options=TuneOptions(meshes=True))
    assert r.mesh_plan is None and r.best[0] is r.plan


def _stage_row(compute, fraction, off_step, m):
    """A stage table row at one layer count (index 1): its seconds per micro-batch with the
    optimizer fraction's per-step offload spread over ``m`` micro-batches, as the tables cost it."""
    table = SimpleNamespace(off_step=np.array([0.0, off_step]))
    row = SimpleNamespace(fraction=np.array([0.0, fraction]),
                          seconds=np.array([np.inf, compute + fraction * off_step / m]))
    return table, row


@pytest.mark.parametrize("stages, expected", [
    # an offload on a stage that is not the slowest: its 4 s run after the drain, in full
    ([(1.0, 1.0, 4.0), (1.8, 0.0, 0.0)], 5 * 1.8 + 4.0),
    # no offload: turns times the slowest stage
    ([(1.0, 0.0, 4.0), (1.8, 0.0, 0.0)], 5 * 1.8),
    # a spread offload already costs more on the slowest stage: never below that (the bounds)
    ([(1.0, 1.0, 40.0), (1.8, 0.0, 0.0)], 5 * (1.0 + 40.0 / 4)),
])
def test_the_estimate_counts_an_optimizer_offload_after_the_drain(stages, expected):
    # the simulator runs each stage's optimizer step (its offload included) after the pipeline
    # drains, so an offload on a fast stage lengthens the step though the split saw it spread
    m, turns = 4, 5.0
    tables, rows = zip(*(_stage_row(c, f, o, m) for c, f, o in stages))
    slowest = max(r.seconds[1] for r in rows)
    got = _estimate(tables, rows, [1, 1], slowest, m, turns)
    assert got == pytest.approx(expected)
    assert got >= turns * slowest
