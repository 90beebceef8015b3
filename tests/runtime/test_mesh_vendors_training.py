"""A mesh plan across vendors (an A100 mesh bridged to an MI300X mesh: NCCL beside RCCL) under
Megatron-LM's own training loop, through ``python -m megatron_hetero.launch`` on CPU ranks
(gloo): ``train_tiny.py``, or Megatron-LM core_v0.19.0's ``pretrain_gpt.py`` with
``MEGATRON_LM_GIT``. The runtime takes the path a device run takes: the world group gloo, each
mesh's groups on its vendor's backend (all gloo on CPU ranks), and the bridge between the
vendors host-staged on a gloo group of its own (megatron_hetero/mcore/bridge_groups.py).

``ref`` (one process, 4 layers, 2 micro-batches of 2, Adam with the distributed optimizer)
trains steps 1-4, saving after step 1; ``vendors`` (A100 TP 1 -> MI300X TP 2, two layers a
mesh, 3 ranks) and ``vendor-chunks`` (the same meshes with two chunks of one layer a stage:
the wrap-around bridge between vendors too) load its step-1 checkpoint and train steps 2-4,
equal to the one process within rtol 1e-5; ``vendor-chunks`` under megatron-core 0.17.1 too."""

from __future__ import annotations

import pytest

from megatron_hetero.plan import save_any_plan, save_plan

from .launching import launch_recorded, name_training_script, training_script
from .plans import A100, make_mesh_plan, make_plan
from .test_checkpoint_resume import CHECKPOINT_ARGS, _close, _steps

pytestmark = pytest.mark.slow

STEPS = 4
MI300X = "MI300X-192GB"
MESHES = [(1, 1, [2], None), (2, 1, [2], None)]  # TP 1 -> TP 2, one stage each


def _train(root, stack: str, runs: list[str]) -> dict:
    """``ref`` and then each of ``runs`` (module docstring) under ``stack``'s megatron-core:
    their records and each rank's output."""
    script, base_args, what = training_script(root, stack)
    save_plan(make_plan(split=(4,), replicas=[(2, 2)], distributed_optimizer=True),
              root / "ref.yaml")
    save_any_plan(make_mesh_plan(MESHES, devices=[A100, MI300X]), root / "vendors.yaml")
    save_any_plan(make_mesh_plan(MESHES, devices=[A100, MI300X],
                                 chunks={0: [[1, 1]], 1: [[1, 1]]}),
                  root / "vendor-chunks.yaml")
    load = ["--load", str(root / "ckpt-ref"), "--ckpt-step", "1", "--no-load-rng"]
    out = {"what": what}
    for run, ranks, extra in [
            ("ref", 1, ["--save", str(root / "ckpt-ref"), "--save-interval", "1"]),
            *((run, 3, load) for run in runs)]:
        results, out[run] = launch_recorded(run, ranks, str(root / f"{run}.yaml"), root,
                                            script=script, base_args=base_args, iters=STEPS,
                                            extra=CHECKPOINT_ARGS + extra, timeout=500,
                                            stack=stack)
        out[run + "-out"] = [text for _, text, _ in results]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``ref``, ``vendors`` and ``vendor-chunks`` (module docstring) under megatron-core
    0.19.2, run once."""
    return _train(tmp_path_factory.mktemp("mesh-vendors"), "0.19", ["vendors", "vendor-chunks"])


@pytest.mark.parametrize("run, bridges", [("vendors", 1), ("vendor-chunks", 2)])
def test_a_mesh_plan_across_vendors_trains_equal_to_one_process(runs, request, run, bridges):
    """Steps 2-4: loss and gradient norm equal the one process's within rtol 1e-5; rank 0
    says the world is gloo and how many bridges between vendors it stages (the forward one,
    and with chunks the wrap-around too)."""
    name_training_script(request, runs["what"])
    ref, got = _steps(runs["ref"]), _steps(runs[run])
    assert sorted(ref) == [1, 2, 3, 4] and sorted(got) == [2, 3, 4]
    _close(got, ref)
    assert (f"GPUs of 2 vendors: world group gloo, {bridges} bridges between meshes across "
            "vendors staged through host memory") in runs[run + "-out"][0]


def test_megatron_core_017_trains_a_chunked_mesh_plan_across_vendors(tmp_path, request):
    """``vendor-chunks`` under megatron-core 0.17.1 (core_v0.17.1's ``pretrain_gpt.py`` with
    ``MEGATRON_LM_GIT``): both bridges between vendors host-staged on groups of their own
    there too; steps 2-4 equal the one process's within rtol 1e-5."""
    got = _train(tmp_path, "0.17", ["vendor-chunks"])
    name_training_script(request, got["what"])
    _close(_steps(got["vendor-chunks"]), _steps(got["ref"]))
    assert sorted(_steps(got["vendor-chunks"])) == [2, 3, 4]
