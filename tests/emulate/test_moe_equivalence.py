"""Mixture-of-experts plans on CPU ranks equal one process: megatron-core's MoE layer, router and
all-to-all token dispatcher under expert parallelism carved out of data parallelism.

The tiny model has 4 routed experts (top-2, dropless: no capacity factor) in 4 of its 6 layers
(``moe_layer_freq`` [0, 1, 1, 0, 1, 1]: dense and MoE layers mixed). Each plan trains 3 steps
with SGD (momentum 0.9: linear in the gradient, so a wrong gradient scale on the experts, which
Adam's normalised update would hide, moves the parameters); losses, the forward-only loss after training and every parameter (each expert under
its global index, gathered from the replica that holds it) must match one process within the
tolerances of ``test_equivalence.py`` (losses rtol 1e-5; parameters rtol 1e-5 + atol 1e-5).
"""

from __future__ import annotations

import pytest

from megatron_hetero.emulate.trainer import TrainConfig, compare_results, reference_plan, train_plan

from .conftest import tiny_plan

pytestmark = pytest.mark.slow

MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
           moe_layer_freq=[0, 1, 1, 0, 1, 1])
CONFIG = TrainConfig(steps=3, optimizer="sgd")


def _trains_as_one_process_with_16_experts(plan) -> None:
    """``plan`` trains 3 steps equal to one process (losses and every parameter, each expert
    under its global index), 4 experts in each of 4 MoE layers."""
    got = train_plan(plan, CONFIG)
    ref = train_plan(reference_plan(plan), CONFIG)
    experts = [n for n in ref.params if ".local_experts." in n]
    assert len(experts) == 4 * 4 * 2  # fc1 and fc2 of 4 experts in 4 MoE layers
    assert sorted(got.params) == sorted(ref.params)
    assert compare_results(got, ref, rtol=1e-5, atol=1e-5) is None


@pytest.mark.parametrize("name, plan", [
    ("pp2_dp2_ep2_split_2_4", tiny_plan([2, 4], [(1, 2), (1, 2)],
                                        expert_model_parallel_size=2, **MOE)),
    ("dp2_ep2_microbatches_3_3", tiny_plan([6], [(1, 3), (1, 3)],
                                           expert_model_parallel_size=2, **MOE)),
])
def test_expert_parallel_plan_equals_one_process(name, plan):
    assert plan.meshes[0].expert_model_parallel_size == 2 and plan.model.is_moe
    _trains_as_one_process_with_16_experts(plan)


def test_rehearsal_of_the_moe_example_verifies(mcore_env):
    """``rehearse examples/rehearse/moe-h100-a100/plan.yaml --verify``: the PP2 x DP2 x EP2
    plan (uneven 5:3 split, 8 experts) rehearses on 4 CPU ranks, every stage of both replicas
    is measured beside its prediction, and, in the plan's bf16, deviates from one fp32 process
    no more than plain Megatron's uniform plan does."""
    import subprocess
    import sys

    from ..conftest import REPO

    example = REPO / "examples" / "rehearse" / "moe-h100-a100"
    out = subprocess.run([sys.executable, "-m", "megatron_hetero.cli", "rehearse",
                          str(example / "plan.yaml"), "--inventory",
                          str(example / "inventory.yaml"), "--steps", "2", "--hidden-size",
                          "32", "--verify"], env=mcore_env | {"PYTHONWARNINGS": "ignore"},
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if "-SXM-80GB" in line and "|" in line]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("0", "0", "H100-SXM-80GB", "5"), ("0", "1", "A100-SXM-80GB", "3"),
        ("1", "0", "H100-SXM-80GB", "5"), ("1", "1", "A100-SXM-80GB", "3")]
    # a bf16 plan verifies in bf16: no further from fp32 one process than plain Megatron's
    # uniform plan in bf16 (measured: both 8.31e-06 in the loss, 6.88e-04 in the parameters)
    assert "verify (bf16, sgd, 2 steps)" in out.stdout
    assert "verify: the plan deviates no more than plain Megatron in bf16" in out.stdout


def _mesh_plan(tmp_path, experts_on_mesh1: int):
    """A chain of two meshes of the tiny MoE model: mesh 0 (TP1, DP1, layers 0-1) feeds mesh 1
    (TP1, DP2, layers 2-5) whose two replicas split its experts ``experts_on_mesh1`` ways."""
    import yaml

    from megatron_hetero.plan import load_any_plan

    from ..mcore.tiny_mesh_plans import tiny_mesh_plan

    path = tiny_mesh_plan(tmp_path, [(1, 1), (1, 2)], stages={0: [2], 1: [4]})
    data = yaml.safe_load(open(path))
    data["model"].update(num_layers=6, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                         num_query_groups=4, seq_length=8, **MOE)
    data["meshes"][1]["expert_model_parallel_size"] = experts_on_mesh1
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return load_any_plan(path)


def test_mesh_plan_with_expert_parallelism_on_one_mesh_equals_one_process(tmp_path):
    """Mesh 0 holds every expert of its MoE layer; mesh 1's replicas hold half each (EP2 on
    that mesh's own expert grid); 3 steps equal one process (losses and every parameter)."""
    plan = _mesh_plan(tmp_path, 2)
    assert [m.expert_model_parallel_size for m in plan.meshes] == [1, 2]
    got = train_plan(plan, CONFIG)
    ref = train_plan(reference_plan(plan), CONFIG)
    assert sorted(got.params) == sorted(ref.params)
    assert compare_results(got, ref, rtol=1e-5, atol=1e-5) is None


def test_moe_model_on_an_interleaved_mesh_chain_equals_one_process(tmp_path, capsys):
    """A chain of two meshes with two model chunks a stage (interleaved 1F1B over the chain:
    mesh 0 TP1 DP1 chunks of 1 and 1 layer, mesh 1 TP1 DP2 with EP2, chunks of 2 and 1), MoE
    layers on both meshes (``moe_layer_freq`` [1, 1, 0, 1, 1]: layers 0 and 3 on mesh 0 at
    EP1, 1 and 4 on mesh 1 at EP2). ``validate`` takes it (Megatron's loop runs chunked chains
    on megatron-core 0.19); the CPU trainer trains it 3 steps equal to one process (losses and
    every parameter, each expert under its global index)."""
    import yaml

    from megatron_hetero.cli import main
    from megatron_hetero.plan import load_any_plan

    from ..mcore.tiny_mesh_plans import tiny_mesh_plan

    path = tiny_mesh_plan(tmp_path, [(1, 1), (1, 2)], chunks={0: [[1, 1]], 1: [[2, 1]]})
    data = yaml.safe_load(open(path))
    data["model"].update(hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                         num_query_groups=4, seq_length=8,
                         **(MOE | {"moe_layer_freq": [1, 1, 0, 1, 1]}))
    data["meshes"][1]["expert_model_parallel_size"] = 2
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    plan = load_any_plan(path)
    assert plan.interleaved_chain and plan.model.num_layers == 5
    assert [m.expert_model_parallel_size for m in plan.meshes] == [1, 2]
    assert main(["validate", path]) == 0, capsys.readouterr().err
    _trains_as_one_process_with_16_experts(plan)


def test_calibration_of_a_model_mixing_moe_and_dense_layers():
    """The rehearsal's calibration times a model of one kind of layer at a time: of a model
    that mixes MoE and dense layers (``moe_layer_freq`` 2 or a list) its MoE layer and its
    dense layer, weighted by their shares; a model of MoE layers only (or a dense one), its
    own. It measures such a model (it refused one before: a 1-layer model of a 5-entry list)."""
    import dataclasses

    from megatron_hetero.emulate.calibration import calibrate, layer_kinds

    plan = tiny_plan([6], [(1, 2)], **MOE)  # pattern [0, 1, 1, 0, 1, 1]
    kinds = layer_kinds(plan.model)
    assert [(k.num_experts, k.moe_layer_freq, share) for k, share in kinds] == [
        (4, 1, pytest.approx(4 / 6)), (None, 1, pytest.approx(2 / 6))]
    every = dataclasses.replace(plan.model, moe_layer_freq=1)
    assert layer_kinds(every) == [(every, 1.0)]
    calibration = calibrate(plan, reps=1, meter=False, timeout_s=120)
    forward, backward = calibration.parts[("layer", 1)]
    assert forward > 0 and backward > 0
