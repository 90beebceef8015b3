"""Per-stage warm-ups over a chain of meshes under Megatron-LM's own training loop, through
``python -m megatron_hetero.launch`` on CPU ranks (gloo): the chain's own schedule
(megatron_hetero/runtime/mesh_chunks.py) runs a chain whose stages warm up other than
Megatron's, interleaved or not. Megatron-LM core_v0.19.0's ``pretrain_gpt.py`` (mock data)
where its git clone is at hand, else the tests' own ``data/train_tiny.py`` (the same
``megatron.training.pretrain``), with the distributed optimizer (Adam), gradient clipping at 1.0
and ``--ckpt-format torch_dist``, as ``test_mesh_interleaved_training.py`` runs the chains with
chunks.

``ref`` (one process, 4 layers, 2 micro-batches of 2) trains steps 1-4, saving after each;
``warm``, TP 1 -> TP 2 of one stage each (3 ranks, 4 micro-batches of 1; no chunks: one chunk
a stage, no virtual pipeline in Megatron's arguments), stage 0 warming up 3 micro-batches
(Megatron's 1), and ``chunks-warm``, the same chain with two chunks of one layer a stage, its
stages warming up 6 and 3 forward chunk-steps of 8 (Megatron's interleaved 4 and 2), each load
``ref``'s step-1 checkpoint and train steps 2-4.
"""

from __future__ import annotations

import pytest

from megatron_hetero.plan import save_any_plan, save_plan
from megatron_hetero.schedule.order import rank_order

from .launching import launch_recorded, name_training_script, training_script
from .plans import make_mesh_plan, make_plan
from .test_checkpoint_resume import CHECKPOINT_ARGS, _close, _steps

pytestmark = pytest.mark.slow

STEPS = 4
CHAIN = [(1, 1, [2], None), (2, 1, [2], None)]  # TP 1 -> TP 2, one stage each


def warm_plan():
    return make_mesh_plan(CHAIN, num_microbatches=4, warmups={0: [3]})


def chunks_warm_plan():
    return make_mesh_plan(CHAIN, num_microbatches=4, chunks={0: [[1, 1]], 1: [[1, 1]]},
                          warmups={0: [6], 1: [3]})


def test_the_plans_warm_up_other_than_megatron():
    """What the runs below train: both run the chain's own schedule, each with an order other
    than Megatron's on the stage given a count."""
    warm, chunks = warm_plan(), chunks_warm_plan()
    assert warm.own_chain_schedule and not warm.interleaved_chain
    assert chunks.own_chain_schedule and chunks.interleaved_chain
    assert rank_order(2, 0, 4, 1, warmup=3) != rank_order(2, 0, 4, 1)
    for s, w in enumerate((6, 3)):
        assert rank_order(2, s, 4, 2, warmup=w) != rank_order(2, s, 4, 2)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """``ref``, ``warm`` and ``chunks-warm`` (module docstring), run once: their records."""
    root = tmp_path_factory.mktemp("warmup-meshes")
    script, base_args, what = training_script(root, "0.19")
    save_plan(make_plan(split=(4,), replicas=[(2, 2)], distributed_optimizer=True),
              root / "ref.yaml")
    save_any_plan(warm_plan(), root / "warm.yaml")
    save_any_plan(chunks_warm_plan(), root / "chunks-warm.yaml")
    records = {}
    load = ["--load", str(root / "ckpt-ref"), "--ckpt-step", "1", "--no-load-rng"]
    runs = [("ref", 1, ["--save", str(root / "ckpt-ref"), "--save-interval", "1"]),
            ("warm", 3, load), ("chunks-warm", 3, load)]
    for run, ranks, extra in runs:
        _, records[run] = launch_recorded(run, ranks, str(root / f"{run}.yaml"), root,
                                          script=script, base_args=base_args, iters=STEPS,
                                          extra=CHECKPOINT_ARGS + extra, timeout=500)
    return {"records": records, "what": what}


@pytest.fixture
def trained(chain, request):
    name_training_script(request, chain["what"])
    return chain


@pytest.mark.parametrize("run", ["warm", "chunks-warm"])
def test_chain_with_warmups_trains_equal_to_one_process(trained, run):
    """Steps 2-4: the loss (on the TP-2 mesh, which holds it) and the whole model's gradient
    norm (on every rank) equal the one process's within rtol 1e-5."""
    rec = trained["records"]
    ref, got = _steps(rec["ref"]), _steps(rec[run])
    assert sorted(ref) == [1, 2, 3, 4] and sorted(got) == [2, 3, 4]
    _close(got, ref)
    records = sorted(rec[run], key=lambda r: r["rank"])
    for r, record in enumerate(records):
        assert [s[0] for s in record["steps"]] == [1, 2, 3]
        assert all((s[1] is not None) == (r >= 1) for s in record["steps"]), r
        assert [s[2] for s in record["steps"]] == [s[2] for s in records[-1]["steps"]]
