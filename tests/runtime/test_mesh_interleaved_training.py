"""Interleaved 1F1B over a chain of meshes (``chunk_layers`` in a mesh plan) under Megatron-LM's
own training loop, through ``python -m megatron_hetero.launch`` on CPU ranks (gloo): Megatron-LM
core_v0.19.0's ``pretrain_gpt.py`` (mock data) where its git clone is at hand, else the tests'
own ``data/train_tiny.py`` (the same ``megatron.training.pretrain``), with the distributed
optimizer (Adam), gradient clipping at 1.0 and ``--ckpt-format torch_dist``, as
``test_mesh_training.py`` runs the chains without chunks.

``ref`` (one process, 4 layers, 2 micro-batches of 2) trains steps 1-4, saving after each;
``chunks``, TP 1 -> TP 2 with two chunks of one layer a stage (3 ranks: the chunks run layers
1, 3 on the TP-1 mesh and 2, 4 on the TP-2 mesh, so every chunk boundary crosses a bridge, the
wrap-around from the TP-2 mesh's chunk 0 to the TP-1 mesh's chunk 1 among them), loads
``ref``'s step-1 checkpoint and trains steps 2-4, saving after steps 2 and 4; ``resume`` (the
same plan) loads its step 2 and trains steps 3-4 again; ``uneven`` (DP 2 -> DP 2, two chunks a
stage, replicas of 2 micro-batches of 2 and 2 of 1) loads ``ref6``'s step 1 (one process, 3
micro-batches of 2) and trains steps 2-4; ``pp2`` (a TP-1 mesh of two stages, then TP 2) loads
``ref``'s step 1 and trains steps 2-4. ``ref`` and ``chunks`` run under megatron-core 0.17.1
too (core_v0.17.1's ``pretrain_gpt.py`` with ``MEGATRON_LM_GIT``), whose bridges send on the
world's group: each bridge gets a group of its own there (megatron_hetero/mcore/bridge_groups.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hetero.plan import save_any_plan, save_plan

from .launching import TRAIN_SCRIPT, launch_recorded, name_training_script, training_script
from .plans import make_mesh_plan, make_plan
from .test_checkpoint_resume import CHECKPOINT_ARGS, _assert_same_state, _close, _steps, _tensors

pytestmark = pytest.mark.slow

STEPS = 4
CHUNKS = [(1, 1, [2], None), (2, 1, [2], None)]  # TP 1 -> TP 2, one stage each
CHUNK_LAYERS = {0: [[1, 1]], 1: [[1, 1]]}
# a mesh of two stages (Megatron's get_model asks for every chunk in one call) -> TP 2; empty
# chunks at the model's two ends; 4 micro-batches of 1 in one group
PP2 = [(1, 1, [1, 2], None), (2, 1, [1], None)]
PP2_CHUNKS = {0: [[0, 1], [1, 1]], 1: [[1, 0]]}
UNEVEN = [(1, 2, [2], None), (1, 2, [2], None)]  # DP 2 -> DP 2, replicas of 2 x 2 and 2 x 1
UNEVEN_REPLICAS = [(2, 2), (1, 2)]


def chunked_plan():
    return make_mesh_plan(CHUNKS, chunks=CHUNK_LAYERS)


def pp2_plan():
    return make_mesh_plan(PP2, chunks=PP2_CHUNKS, num_microbatches=4,
                          fields={"microbatch_group_size": 4})


def uneven_plan():
    return make_mesh_plan(UNEVEN, chunks=CHUNK_LAYERS, replicas=UNEVEN_REPLICAS, global_batch=6)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """``ref``, ``chunks``, ``resume``, ``pp2``, ``ref6`` and ``uneven`` (module docstring),
    run once: their records."""
    root = tmp_path_factory.mktemp("interleaved-meshes")
    script, base_args, what = training_script(root, "0.19")
    save_plan(make_plan(split=(4,), replicas=[(2, 2)], distributed_optimizer=True),
              root / "ref.yaml")
    save_plan(make_plan(split=(4,), replicas=[(2, 3)], distributed_optimizer=True),
              root / "ref6.yaml")
    save_any_plan(chunked_plan(), root / "chunks.yaml")
    save_any_plan(uneven_plan(), root / "uneven.yaml")
    save_any_plan(pp2_plan(), root / "pp2.yaml")
    records = {}
    runs = [("ref", "ref", 1, ["--save", str(root / "ckpt-ref"), "--save-interval", "1"]),
            ("chunks", "chunks", 3, ["--load", str(root / "ckpt-ref"), "--ckpt-step", "1",
                                     "--no-load-rng", "--save", str(root / "ckpt-chunks"),
                                     "--save-interval", "2"]),
            ("resume", "chunks", 3, ["--load", str(root / "ckpt-chunks"), "--ckpt-step", "2",
                                     "--save", str(root / "ckpt-resume"),
                                     "--save-interval", "2"]),
            ("pp2", "pp2", 4, ["--load", str(root / "ckpt-ref"), "--ckpt-step", "1",
                               "--no-load-rng"]),
            ("ref6", "ref6", 1, ["--save", str(root / "ckpt-ref6"), "--save-interval", "1"]),
            ("uneven", "uneven", 4, ["--load", str(root / "ckpt-ref6"), "--ckpt-step", "1",
                                     "--no-load-rng"])]
    for run, plan, ranks, extra in runs:
        results, records[run] = launch_recorded(
            run, ranks, str(root / f"{plan}.yaml"), root, script=script, base_args=base_args,
            iters=STEPS, extra=CHECKPOINT_ARGS + extra, timeout=500)
        records[run + "-logs"] = [log for _, _, log in results]
    return {"records": records, "root": root, "what": what, "script": script}


@pytest.fixture
def trained(chain, request):
    name_training_script(request, chain["what"])
    return chain


def test_interleaved_mesh_plan_trains_equal_to_one_process(trained):
    """Steps 2-4 of ``chunks``: the loss (on the TP-2 mesh, which holds the loss) and the
    whole model's gradient norm (on every rank) equal the one process's within rtol 1e-5; each
    rank built two chunks of one layer, numbered as in the one process (chunk c of global stage
    s is virtual stage 2c + s; ``train_tiny.py`` logs them, Megatron-LM's script does not: its
    checkpoint's keys below say the same)."""
    rec = trained["records"]
    ref, got = _steps(rec["ref"]), _steps(rec["chunks"])
    assert sorted(ref) == [1, 2, 3, 4] and sorted(got) == [2, 3, 4]
    _close(got, ref)
    records = sorted(rec["chunks"], key=lambda r: r["rank"])
    for r, record in enumerate(records):
        assert [s[0] for s in record["steps"]] == [1, 2, 3]
        assert all((s[1] is not None) == (r >= 1) for s in record["steps"]), r
        assert [s[2] for s in record["steps"]] == [s[2] for s in records[-1]["steps"]]
    if trained["script"] == TRAIN_SCRIPT:  # its log names each chunk's layers
        layers = {log["rank"]: [chunk[0] for chunk in log["chunks"]]
                  for log in rec["chunks-logs"]}
        assert layers == {0: [[1], [3]], 1: [[2], [4]], 2: [[2], [4]]}


def test_interleaved_mesh_plan_resumes_equal_to_the_uninterrupted_run(trained, tmp_path):
    """``chunks`` resumed from its own step-2 checkpoint trains steps 3-4 as before and writes
    the same step-4 checkpoint (weights and Adam state), which holds the one process's step-4
    state under the same keys (each layer under its global number)."""
    rec, root = trained["records"], trained["root"]
    full, resumed = _steps(rec["chunks"]), _steps(rec["resume"])
    assert sorted(resumed) == [3, 4]
    _close(resumed, full)
    a = _tensors(root / "ckpt-chunks" / "iter_0000004", tmp_path, "0.19")
    b = _tensors(root / "ckpt-resume" / "iter_0000004", tmp_path, "0.19")
    assert a.keys() == b.keys()
    assert any(k.startswith("/optimizer.state.exp_avg_sq.") for k in a)
    _assert_same_state(a, b, keys=a)
    ref = _tensors(root / "ckpt-ref" / "iter_0000004", tmp_path, "0.19")
    layers = [k for k in ref if k.startswith("/decoder.layers.")]
    assert layers and set(layers) <= set(a)
    common = [k for k in ref if k in a]
    assert any(k.startswith("/optimizer.state.exp_avg.decoder.layers.") for k in common)
    _assert_same_state(a, ref, keys=common)


def test_a_mesh_of_two_stages_with_chunks_trains_equal_to_one_process(trained):
    """``pp2``: a TP-1 mesh of two stages (chunks of 0 + 1 and 1 + 1 layers) then one TP-2
    stage (1 + 0), 4 micro-batches of 1 in one group: Megatron's ``get_model`` builds both
    chunks of a two-stage mesh's rank in one call; steps 2-4 equal the one process's (2
    micro-batches of 2) within rtol 1e-5."""
    rec = trained["records"]
    got = _steps(rec["pp2"])
    assert sorted(got) == [2, 3, 4]
    _close(got, _steps(rec["ref"]))
    if trained["script"] == TRAIN_SCRIPT:
        layers = {log["rank"]: [chunk[0] for chunk in log["chunks"]] for log in rec["pp2-logs"]}
        assert layers == {0: [[], [3]], 1: [[1], [4]], 2: [[2], []], 3: [[2], []]}


def test_uneven_replicas_with_chunks_train_equal_to_one_process(trained):
    """``uneven``: DP 2 -> DP 2 with two chunks a stage, the replicas running 2 micro-batches of
    2 and 2 of 1 (per-token loss, each replica its own share of the global batch of 6):
    steps 2-4 equal the one process's (3 micro-batches of 2) within rtol 1e-5."""
    rec = trained["records"]
    ref, got = _steps(rec["ref6"]), _steps(rec["uneven"])
    assert sorted(ref) == [1, 2, 3, 4] and sorted(got) == [2, 3, 4]
    _close(got, ref)


def test_megatron_core_017_trains_an_interleaved_mesh_plan_equal_to_one_process(tmp_path,
                                                                              request):
    """``ref`` and ``chunks`` under megatron-core 0.17.1 (core_v0.17.1's ``pretrain_gpt.py``
    with ``MEGATRON_LM_GIT``), whose bridges send on the world's group: each bridge gets a
    group of its own there too (the forward bridge and the wrap-around join the same two
    ranks); steps 2-4 equal the one process's within rtol 1e-5."""
    script, base_args, what = training_script(tmp_path, "0.17")
    name_training_script(request, what)
    save_plan(make_plan(split=(4,), replicas=[(2, 2)], distributed_optimizer=True),
              tmp_path / "ref.yaml")
    save_any_plan(chunked_plan(), tmp_path / "chunks.yaml")
    records = {}
    for run, ranks, extra in [
            ("ref", 1, ["--save", str(tmp_path / "ckpt-ref"), "--save-interval", "1"]),
            ("chunks", 3, ["--load", str(tmp_path / "ckpt-ref"), "--ckpt-step", "1",
                           "--no-load-rng"])]:
        _, records[run] = launch_recorded(run, ranks, str(tmp_path / f"{run}.yaml"), tmp_path,
                                          script=script, base_args=base_args, iters=STEPS,
                                          extra=CHECKPOINT_ARGS + extra, timeout=500,
                                          stack="0.17")
    ref, got = _steps(records["ref"]), _steps(records["chunks"])
    assert sorted(ref) == [1, 2, 3, 4] and sorted(got) == [2, 3, 4]
    _close(got, ref)
