"""Equivalence of real megatron-core training on CPU ranks under different plans.

The same model, data and seed train for 3 steps under (a) one process, (b) PP=2 split 1:5
(with full recompute on stage 1), (c) DP=2 with micro-batch counts 3:1, (d) PP=2 x DP=2 with
both, (e) TP=2, (f) TP=2 x PP=2, (g) PP=2 with the embedding alone on stage 0, (h) (d) with
Megatron's distributed optimizer (the others use the plain fp32 one), (i) interleaved
pipelining: PP=2 with 2 model chunks per stage (chunks 1+1 and 3+1 layers) x DP=2 with
micro-batch counts 4:2, block recompute of 2 layers on stage 1, (j) (i) and (k) (d) with
the gradient reduction overlapped with the last backward (``overlap_grad_reduce``), (l) TP=2 x
interleaved PP=2 whose first chunk holds only the embedding (layout E|t*3|t*2|tL). Losses, the
forward-only loss after training and the final parameters must match (a).

Tolerance: losses within rtol 1e-5. Parameters within rtol 1e-5 plus atol 1e-5 (1% of one Adam
step, lr 1e-3): the plans sum gradients in different orders (per micro-batch, per replica, per
TP shard), and Adam divides each update by the gradient's own running magnitude, so the rare
element whose gradient nearly cancels turns fp32 rounding into an update difference that no
relative tolerance on the parameter absorbs (measured: TP=2 moves 1 element in 2048 of a
linear_fc2 weight by 4e-6, everything else by < 1e-6). A wrong data share or layer split moves
parameters by about a full step and the losses from step 0 (see test_wrong_share_is_caught).
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from megatron_hetero.emulate.trainer import (RankHooks, TrainConfig, compare_results,
                                             reference_plan, train_plan)

from ..conftest import OLD_STACK, evaluate_under, evaluated
from .conftest import tiny_plan

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-5, 1e-5
CONFIG = TrainConfig(steps=3)
FULL_RECOMPUTE = {"granularity": "full", "method": "uniform", "num_layers": 1}
BLOCK_RECOMPUTE_2 = {"granularity": "full", "method": "block", "num_layers": 2}

PLANS = {
    "b_pp2_split_1_5": tiny_plan([1, 5], [(1, 4)], recompute=[None, FULL_RECOMPUTE]),
    "c_dp2_microbatches_3_1": tiny_plan([6], [(1, 3), (1, 1)]),
    "d_pp2_dp2": tiny_plan([1, 5], [(1, 3), (1, 1)]),
    "e_tp2": tiny_plan([6], [(1, 4)], tp=2),
    "f_tp2_pp2_split_2_4": tiny_plan([2, 4], [(1, 4)], tp=2),
    "g_pp2_embedding_alone": tiny_plan([0, 6], [(1, 4)]),
    "h_pp2_dp2_distributed_optimizer": tiny_plan([1, 5], [(1, 3), (1, 1)],
                                                 use_distributed_optimizer=True),
    "i_pp2_vp2_dp2_chunks_1_1_3_1": tiny_plan(None, [(1, 4), (1, 2)], chunks=[[1, 1], [3, 1]],
                                              recompute=[None, BLOCK_RECOMPUTE_2]),
    "j_i_with_overlapped_grad_reduce": tiny_plan(None, [(1, 4), (1, 2)], chunks=[[1, 1], [3, 1]],
                                                 overlap_grad_reduce=True),
    "k_d_with_overlapped_grad_reduce": tiny_plan([1, 5], [(1, 3), (1, 1)],
                                                 overlap_grad_reduce=True),
    "l_tp2_pp2_vp2_embedding_alone_first": tiny_plan(None, [(1, 4)], chunks=[[0, 2], [3, 1]],
                                                     tp=2),
}
# global batch 6: an interleaved plan's micro-batch counts are multiples of PP
OWN_BATCH = {"i_pp2_vp2_dp2_chunks_1_1_3_1", "j_i_with_overlapped_grad_reduce"}


@pytest.fixture(scope="module")
def reference():
    """(a): the same model and global batch on one process."""
    ref = reference_plan(PLANS["b_pp2_split_1_5"])
    assert ref.world_size == 1 and not ref.use_distributed_optimizer
    assert all(reference_plan(p) == ref for n, p in PLANS.items() if n not in OWN_BATCH)
    return train_plan(ref, CONFIG)


@pytest.fixture(scope="module")
def references(reference):
    """Reference results by reference plan (plans with their own global batch get their own)."""
    cache = [(reference_plan(PLANS["b_pp2_split_1_5"]), reference)]  # plans are not hashable

    def get(plan):
        ref = reference_plan(plan)
        for known, result in cache:
            if known == ref:
                return result
        cache.append((ref, train_plan(ref, CONFIG)))
        return cache[-1][1]
    return get


def test_reference_trains(reference):
    assert len(reference.losses) == CONFIG.steps
    assert reference.eval_loss is not None  # the forward-only schedule ran
    assert len(set(reference.losses)) == CONFIG.steps  # the model changes between steps
    names = set(reference.params)
    assert {"embedding.word_embeddings.weight", "output_layer.weight",
            "decoder.final_layernorm.weight", "decoder.layers.5.mlp.linear_fc2.weight"} <= names


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_matches_one_process(name, references):
    reference = references(PLANS[name])
    config = dataclasses.replace(CONFIG, use_distributed_optimizer=None)  # as the plan says
    result = train_plan(PLANS[name], config, hooks_factory=_optimizer_kinds)
    assert compare_results(result, reference, rtol=RTOL, atol=ATOL) is None
    for r in result.ranks:  # every rank sees the global gradient norm of the reference
        assert r.grad_norms == pytest.approx(reference.ranks[0].grad_norms, rel=1e-4)
    distributed = {"DistributedOptimizer" in r.extra for r in result.ranks}
    assert distributed == {PLANS[name].use_distributed_optimizer}


def _optimizer_kinds(plan, rank):
    kinds = []

    def on_built(chunks, optimizer):
        for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            kinds.append(type(inner).__name__)

    return RankHooks(on_built=on_built, report=lambda: kinds)


@pytest.mark.parametrize("name", ["d_pp2_dp2", "f_tp2_pp2_split_2_4"])
def test_sgd_matches_to_rounding(name):
    """SGD is linear in the gradients, so the plans agree to fp32 rounding (atol 1e-7 only for
    elements near zero, where rtol has nothing to scale)."""
    config = TrainConfig(steps=3, optimizer="sgd", lr=0.1)
    plan = PLANS[name]
    result, ref = train_plan(plan, config), train_plan(reference_plan(plan), config)
    assert compare_results(result, ref, rtol=RTOL, atol=1e-7) is None


def _wrong_share(plan, rank):
    """Every replica reads the first samples of the batch instead of its own share."""
    from megatron_hetero.emulate import data
    data.share_offset = lambda plan, slot: 0
    return RankHooks()


def test_wrong_share_is_caught(reference):
    result = train_plan(PLANS["c_dp2_microbatches_3_1"], CONFIG, hooks_factory=_wrong_share)
    assert compare_results(result, reference, rtol=RTOL, atol=ATOL) is not None


def _mean_loss_per_replica(plan, rank):
    """Megatron's default loss: a mean per replica, then averaged over replicas."""
    from megatron_hetero.emulate import rank_backends
    build = rank_backends.plan_transformer_config

    def transformer_config(plan, stage, chunk=None, **settings):
        config = build(plan, stage, chunk, **settings)
        config.calculate_per_token_loss = False
        return config

    rank_backends.plan_transformer_config = transformer_config
    return RankHooks()


def test_uneven_replicas_need_per_token_loss(reference):
    """Without calculate_per_token_loss, a 3:1 split weighs the lone micro-batch 3x: caught."""
    result = train_plan(PLANS["c_dp2_microbatches_3_1"], CONFIG,
                        hooks_factory=_mean_loss_per_replica)
    assert compare_results(result, reference, rtol=RTOL, atol=ATOL) is not None


def test_tied_embeddings_pp2():
    """The last stage's copy of a shared embedding is synchronized through the embedding group."""
    plan = tiny_plan([1, 5], [(1, 4)], untie_embeddings_and_output_weights=False)
    result, ref = train_plan(plan, CONFIG), train_plan(reference_plan(plan), CONFIG)
    assert "output_layer.weight" not in ref.params
    assert compare_results(result, ref, rtol=RTOL, atol=ATOL) is None


class _Counter:
    def __init__(self):
        self.counts = {"forward": 0, "backward": 0}
        self.steps = []

    def compute(self, kind):
        import contextlib
        self.counts[kind] += 1
        return contextlib.nullcontext()


def _counting_hooks(plan, rank):
    counter = _Counter()
    return RankHooks(compute=counter.compute,
                     on_step_end=lambda step, wall: counter.steps.append((step, wall > 0)),
                     report=lambda: (counter.counts, counter.steps))


def test_hooks_see_every_micro_batch_step():
    plan = PLANS["d_pp2_dp2"]
    config = TrainConfig(steps=2, gather_params=False)
    result = train_plan(plan, config, hooks_factory=_counting_hooks)
    for r in result.ranks:
        counts, steps = r.extra
        n = config.steps * plan.pipelines[r.pipeline].num_microbatches
        assert counts == {"forward": n, "backward": n}, (r.rank, counts)
        assert steps == [(0, True), (1, True)]
        assert len(result.step_times[r.rank]) == config.steps


UNDER_017 = {"b": "tiny_plan([1, 5], [(1, 4)])",
             "i_interleaved": "tiny_plan(None, [(1, 4), (1, 2)], chunks=[[1, 1], [3, 1]])"}


@pytest.fixture(scope="module")
def under_017() -> dict:
    """megatron-core's version and the first divergence from one process of each plan of
    ``UNDER_017`` trained 3 steps, both plans in one subprocess with PYTHONPATH=.venv/mcore017."""
    prelude = textwrap.dedent("""
        import megatron.core
        from megatron_hetero.emulate.trainer import (TrainConfig, compare_results,
                                                     reference_plan, train_plan)
        from tests.emulate.conftest import tiny_plan

        def versus_one_process(plan):
            config = TrainConfig(steps=3)
            return [megatron.core.__version__,
                    compare_results(train_plan(plan, config),
                                    train_plan(reference_plan(plan), config), rtol=%r, atol=%r)]
    """ % (RTOL, ATOL))
    return evaluate_under(prelude, {name: f"versus_one_process({plan})"
                                        for name, plan in UNDER_017.items()}, timeout=240 * 2,
                          stack=OLD_STACK)


@pytest.mark.parametrize("name", list(UNDER_017))
def test_megatron_core_017(under_017, name):
    """(b) and an interleaved plan like (i) under megatron-core 0.17.1, the oldest supported (a
    subprocess with PYTHONPATH=.venv/mcore017; the tests above run on the venv's 0.19.2)."""
    version, diff = evaluated(under_017, name)
    assert version.startswith("0.17"), version
    assert diff is None, diff


def _chunk_hooks(plan, rank):
    """Reports each model chunk's global layer numbers and counts the micro-batch steps."""
    counter, chunks = _Counter(), []

    def on_built(ddps, optimizer):
        for ddp in ddps:
            c = ddp.module.config
            chunks.append(([layer.layer_number for layer in ddp.module.decoder.layers],
                           (c.recompute_granularity, c.recompute_num_layers)))

    return RankHooks(compute=counter.compute, on_built=on_built,
                     report=lambda: (chunks, counter.counts))


def test_interleaved_plan_runs_model_chunks():
    """(i) really runs the interleaved schedule: every rank holds its stage's 2 chunks with the
    plan's layers (chunk-major model order) and runs each micro-batch once per chunk; stage 1's
    block recompute of 2 layers covers 2 of chunk 0's 3 layers and none of chunk 1's."""
    plan = PLANS["i_pp2_vp2_dp2_chunks_1_1_3_1"]
    assert plan.layout() == "Et|t*3|t|tL"
    config = TrainConfig(steps=1, gather_params=False, eval_forward_only=False)
    result = train_plan(plan, config, hooks_factory=_chunk_hooks)
    none = (None, None)  # stage -> (layers (1-based), recompute) of each chunk
    expected = {0: [([1], none), ([5], none)], 1: [([2, 3, 4], ("full", 2)), ([6], none)]}
    for r in result.ranks:
        chunks, counts = r.extra
        assert chunks == expected[r.stage], (r.rank, chunks)
        n = 2 * plan.pipelines[r.pipeline].num_microbatches
        assert counts == {"forward": n, "backward": n}, (r.rank, counts)


def test_interleaved_sgd_matches_to_rounding():
    config = TrainConfig(steps=2, optimizer="sgd", lr=0.1)
    plan = PLANS["i_pp2_vp2_dp2_chunks_1_1_3_1"]
    result, ref = train_plan(plan, config), train_plan(reference_plan(plan), config)
    assert compare_results(result, ref, rtol=RTOL, atol=1e-7) is None


def _order_hooks(plan, rank):
    """Records the rank's forwards and backwards in run order, each forward with its model
    chunk (the k-th forward of a chunk is its k-th micro-batch)."""
    seq, chunks = [], []

    def compute(kind):
        import contextlib
        seq.append(kind[0].upper())
        return contextlib.nullcontext()

    def on_built(ddps, optimizer):
        for c, ddp in enumerate(ddps):
            def forward(*a, _c=c, _f=ddp.forward, **kw):
                chunks.append(_c)
                return _f(*a, **kw)
            ddp.forward = forward

    return RankHooks(compute=compute, on_built=on_built, report=lambda: (seq, chunks))


def test_micro_batch_group_runs_in_the_order_the_simulator_assumes():
    """A plan with its own micro-batch group (3 on 2 stages, 6 micro-batches per replica):
    Megatron's interleaved schedule, given the group through the config as Megatron-LM's
    arguments give it, runs each rank's forwards and backwards in the order
    ``cost.schedule.rank_order`` (which the simulator and the memory model use) says for that
    group, not the default's; and training matches one process to rounding."""
    from megatron_hetero.schedule.order import rank_order
    plan = tiny_plan(None, [(1, 6), (1, 6)], chunks=[[1, 1], [3, 1]], microbatch_group_size=3)
    config = TrainConfig(steps=1, optimizer="sgd", lr=0.1, eval_forward_only=False)
    result = train_plan(plan, config, hooks_factory=_order_hooks)
    for r in result.ranks:
        seq, chunks = r.extra
        want = rank_order(2, r.stage, 6, 2, 3)
        assert seq == ["FB"[k] for k, _, _ in want], r.rank
        assert chunks == [c for k, _, c in want if k == 0], r.rank
        assert chunks != [c for k, _, c in rank_order(2, r.stage, 6, 2) if k == 0]
    ref = train_plan(reference_plan(plan), config)
    assert compare_results(result, ref, rtol=RTOL, atol=1e-7) is None


def test_micro_batches_that_skip_the_pipeline_size_run_in_whole_groups():
    """9 micro-batches on 2 stages with 2 chunks each, in groups of 3 (the tuner's plans for a
    global batch the pipeline size does not divide): Megatron's interleaved schedule takes them
    and runs the order ``cost.schedule.rank_order`` says, and training matches one process."""
    from megatron_hetero.schedule.order import rank_order
    plan = tiny_plan(None, [(1, 9)], chunks=[[1, 1], [3, 1]], microbatch_group_size=3)
    config = TrainConfig(steps=1, optimizer="sgd", lr=0.1, eval_forward_only=False)
    result = train_plan(plan, config, hooks_factory=_order_hooks)
    for r in result.ranks:
        seq, chunks = r.extra
        want = rank_order(2, r.stage, 9, 2, 3)
        assert seq == ["FB"[k] for k, _, _ in want], r.rank
        assert chunks == [c for k, _, c in want if k == 0], r.rank
    ref = train_plan(reference_plan(plan), config)
    assert compare_results(result, ref, rtol=RTOL, atol=1e-7) is None

