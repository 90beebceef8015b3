"""A mixture-of-experts plan through Megatron's own training loop on CPU ranks: ``python -m
megatron_hetero.launch --cpu`` with ``--hetero-plan``; the training script builds megatron-core's
MoE layers from the arguments the plan implies (``--num-experts``, ``--moe-*``,
``--expert-model-parallel-size``); tokens travel by the all-to-all dispatcher over gloo, routing
is dropless.

Megatron initialises weights per pipeline and expert-parallel rank, so the plan shares its
starting point with one process through a checkpoint, as the checkpoint chain does: one process
trains a step and saves it (``torch_dist``; the plain optimizer: megatron-core's distributed
optimizer takes Adam only); the PP2 (layers 1:2) x DP2 x EP2 plan, a chain of
two meshes (layer 0 on one rank, layers 1-2 on two replicas with EP2 on that mesh alone) and one
process each load it (PP 1 -> 2, EP 1 -> 2: the experts resharded by megatron-core's distributed
checkpointing) and train steps 2-3 with SGD. Every sample's loss in steps 2 and 3 (the second after an
update under expert parallelism) matches within rtol 1e-5.

Both load the weights only (``--no-load-optim``): megatron-core 0.19.2 refuses the one
process's optimizer state on the expert-parallel plan ("Expected 2 entries in state dict, but
got 4": its chained optimizer holds a different number of sub-optimizers once experts are
split), measured here.
"""

from __future__ import annotations

import re

import pytest

from megatron_hetero.plan import mesh_plan_from_data, save_any_plan, save_plan

from .launching import launch, together
from .plans import make_mesh_plan, make_plan

pytestmark = pytest.mark.slow

EXPERTS = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
           "moe_layer_freq": [1, 0, 1],
           "untie_embeddings_and_output_weights": True}  # as mesh plans have it
PP2_DP2_EP2 = make_plan(split=(1, 2), replicas=[(1, 2), (1, 2)], experts=EXPERTS,
                        expert_model_parallel_size=2)
ONE_PROCESS = make_plan(split=(3,), replicas=[(1, 4)], experts=EXPERTS)


def _with_experts(data: dict, ep: dict[int, int]) -> dict:
    """A mesh plan's data with the MoE model and ``ep[k]`` as mesh k's expert parallelism."""
    data["model"].update(EXPERTS)
    for k, size in ep.items():
        data["meshes"][k]["expert_model_parallel_size"] = size
    return data


MESHES_EP2_ON_ONE = mesh_plan_from_data(_with_experts(make_mesh_plan(
    [(1, 1, [1], None), (1, 2, [2], None)], global_batch=4, num_microbatches=2,
    distributed_optimizer=False).to_data(),
    {1: 2}), source="test-mesh-plan")
CHECKPOINT = ["--ckpt-format", "torch_dist"]


def _by_step(log, steps: int) -> list[dict[int, float]]:
    """Per step, each sample's loss sum this rank computed (keyed by dataset index)."""
    n = len(log["losses"]) // steps
    return [{i[0]: loss for i, (loss, _) in zip(log["indices"][k * n:(k + 1) * n],
                                                 log["losses"][k * n:(k + 1) * n])}
            for k in range(steps)]


def test_expert_parallel_plan_equals_one_process(tmp_path, mcore_env):
    for name, plan in (("one", ONE_PROCESS), ("ep", PP2_DP2_EP2), ("mesh", MESHES_EP2_ON_ONE)):
        save_any_plan(plan, tmp_path / f"{name}.yaml")
        (tmp_path / name).mkdir()
    ckpt = str(tmp_path / "ckpt-start")
    (tmp_path / "start").mkdir()
    [start] = launch(1, str(tmp_path / "one.yaml"), tmp_path / "start", iters=1,
                     extra=CHECKPOINT + ["--save", ckpt, "--save-interval", "1"])
    assert start[0] == 0, start[1][-3000:]
    # SGD: linear in the gradient, so a wrong gradient scale (which Adam's normalised update
    # hides) changes the next step's losses
    resume = CHECKPOINT + ["--load", ckpt, "--no-load-optim", "--no-load-rng",
                           "--optimizer", "sgd"]
    [one], ep, mesh = together(
        lambda: launch(1, str(tmp_path / "one.yaml"), tmp_path / "one", iters=3, extra=resume),
        lambda: launch(4, str(tmp_path / "ep.yaml"), tmp_path / "ep", iters=3, extra=resume),
        lambda: launch(3, str(tmp_path / "mesh.yaml"), tmp_path / "mesh", iters=3,
                       extra=resume))
    for code, out, _ in [one, *ep, *mesh]:
        assert code == 0, out[-3000:]
    # Megatron's own argument dump: the plan's expert parallelism and MoE layers took effect
    assert re.search(r"expert_model_parallel_size \.+ 2\n", ep[0][1])
    assert re.search(r"num_experts \.+ 4\n", ep[0][1])
    reference = _by_step(one[2], 2)
    for run in (ep, mesh):
        last = [log for _, _, log in run if log and log["losses"]]
        assert len(last) == 2  # the last stage of each replica computes the loss
        for step, want in enumerate(reference, start=2):
            got = {k: v for log in last for k, v in _by_step(log, 2)[step - 2].items()}
            assert got.keys() == want.keys() and len(want) == 4, step
            for i, loss in want.items():
                assert got[i] == pytest.approx(loss, rel=1e-5), (step, i)


@pytest.mark.parametrize("name, plan, ranks", [("ep", PP2_DP2_EP2, 4),
                                               ("mesh", MESHES_EP2_ON_ONE, 3)])
def test_telemetry_counts_the_tokens_routed_to_each_expert(tmp_path, mcore_env, name, plan,
                                                           ranks):
    """``--hetero-telemetry`` in Megatron's loop, on the PP2 x DP2 x EP2 plan and on the chain
    of two meshes with EP2 on the second: each step's record counts, per MoE layer (1 on the
    first stage, 3 on the second, numbered in the whole model), the top-2 copies of every token
    of the global batch, summed over the ranks; each layer's imbalance and the step's are the
    most loaded expert over the mean of those counts, at least 1."""
    from megatron_hetero.telemetry.records import read_records

    path = tmp_path / "plan.yaml"
    save_any_plan(plan, path)
    out = tmp_path / "telemetry"
    results = launch(ranks, str(path), tmp_path, iters=2, timeout=400,
                     extra=["--hetero-telemetry", str(out), "--hetero-telemetry-interval", "1"])
    for code, text, _ in results:
        assert code == 0, text[-3000:]
    model = plan.model
    copies = model.moe_router_topk * plan.global_batch_size * model.seq_length
    devices = [plan.stage_of_slot(plan.slot_of_rank(r)).device_type for r in (0, ranks - 1)]
    records = read_records(out)
    assert [r.step for r in records] == [1, 2]
    for rec in records:
        assert [(row.layer, row.device_type) for row in rec.experts] == [
            (1, devices[0]), (3, devices[1])]
        for row in rec.experts:
            assert len(row.tokens) == 4 and sum(row.tokens) == copies
            assert row.imbalance == pytest.approx(max(row.tokens) / (copies / 4))
            assert row.imbalance >= 1
        assert rec.moe_load_imbalance == pytest.approx(
            sum(max(r.tokens) for r in rec.experts) / (2 * copies / 4))
