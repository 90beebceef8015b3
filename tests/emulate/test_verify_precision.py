"""``rehearse --verify`` in the plan's precision (issue 33, item 1): an uneven plan (PP=2 split
1:5, replicas of 3 and 1 micro-batches) trained by the CPU trainer in bf16 and in fp16 (dynamic
loss scaling) deviates from the fp32 one-process run no more than plain Megatron's uniform plan
(replicas of 2 and 2 micro-batches, one stage) in the same precision; fp16's found overflow and skipped steps agree across the uneven replicas
(also where only one replica overflows); a replica reading wrong labels fails the verdict; and
the CLI prints what it compared.

Measured (2026-11-28 01:00 UTC, load average about 8 on 2 cores; the runs are deterministic,
so load does not move the figures), 4 SGD steps, deviation from fp32 one process as (largest
relative loss difference, relative L2 of all final parameters):

- bf16: uneven plan (5.17e-05, 4.27e-04), plain Megatron's uniform plan (5.17e-05, 4.27e-04);
  with replica 1 reading wrong labels (the deliberate bug) the plan's is (3.74e-03, 4.42e-04):
  72x the loss deviation, which fails the verdict (the parameters' L2 is mostly the 16-bit
  rounding of every weight, alike in all runs, so the losses are what a wrong share moves).
- fp16 (loss scale 32768, hysteresis 1): steps 0 and 1 skipped in both runs, every rank
  agreeing; uneven plan (1.06e-04, 2.25e-04), plain Megatron's uniform plan (1.06e-04,
  2.25e-04).

Both runs of a precision agree to 3 digits (as Megatron's own loop does in
tests/runtime/test_mixed_precision.py: bf16 6.2e-5 vs 6.2e-5, fp16 1.68e-3 vs 1.68e-3): the
uneven plan adds no rounding of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

from megatron_hetero.emulate.trainer import RankResult, TrainConfig, TrainResult
from megatron_hetero.emulate.verify import (Deviation, PrecisionVerdict, fp16_initial_loss_scale,
                                            rank_disagreement, train_and_verify, verdict_lines)

from .conftest import tiny_plan
from .faults import overflow_on_replica, wrong_labels

PLAN = tiny_plan([1, 5], [(1, 3), (1, 1)])
# 32768: the tiny model overflows at 16384 and trains at 8192 (loss summed over 8 tokens), so
# with hysteresis 1 steps 0 and 1 are skipped and steps 2 and 3 train
CONFIG = TrainConfig(steps=4, optimizer="sgd", initial_loss_scale=32768.0,
                     loss_scale_hysteresis=1)


def _verify(precision, hooks=None):
    plan = dataclasses.replace(PLAN, precision=precision)
    config = dataclasses.replace(CONFIG, precision=precision)
    return train_and_verify(plan, config, hooks=hooks, verify=True, say=print)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_uneven_plan_deviates_no_more_than_plain_megatron(precision):
    result, message, verdict = _verify(precision)
    assert message is None and verdict is not None
    print("\n".join(verdict_lines(verdict, PLAN.world_size)))
    assert verdict.precision == precision and verdict.baseline_world_size == 2  # 2 + 2
    assert verdict.plan.loss > 0 and verdict.plan.params > 0  # 16-bit rounding is there
    assert verdict.ok, verdict
    import torch
    want = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert want in {t.dtype for t in result.params.values()}  # trained in the precision
    if precision == "fp16":
        assert verdict.skipped == [True, True, False, False] == verdict.baseline_skipped
        assert verdict.loss_scales == [16384.0, 8192.0, 8192.0, 8192.0]
        assert verdict.disagreement is None
        assert all(r.skipped == verdict.skipped for r in result.ranks)
    else:
        assert not any(verdict.skipped) and set(verdict.loss_scales) == {1.0}


@pytest.mark.slow
def test_one_replicas_overflow_skips_every_replicas_step():
    """Replica 1 (one micro-batch) alone gets an infinite gradient in step 2: every rank of both
    replicas skips step 2 and halves its loss scale alike."""
    plan = dataclasses.replace(PLAN, precision="fp16")
    config = dataclasses.replace(CONFIG, precision="fp16", gather_params=False)
    from megatron_hetero.emulate.trainer import train_plan

    result = train_plan(plan, config, hooks_factory=functools.partial(overflow_on_replica,
                                                                      replica=1, step=2))
    assert [r.skipped for r in result.ranks] == [[True, True, True, False]] * 4
    assert [r.loss_scales for r in result.ranks] == [[16384.0, 8192.0, 4096.0, 4096.0]] * 4
    assert rank_disagreement(result) is None


@pytest.mark.slow
def test_wrong_labels_fail_the_bf16_verdict():
    """The deliberate bug: replica 1 reads wrong labels from step 1 on. Its bf16 run deviates
    far more than plain Megatron's, and the verdict says FAILED."""
    _, _, verdict = _verify("bf16", hooks=functools.partial(wrong_labels, wrong_replica=1))
    lines = verdict_lines(verdict, PLAN.world_size)
    print("\n".join(lines))
    assert not verdict.ok and verdict.plan.loss > 10 * verdict.baseline.loss
    assert lines[-1].startswith("verify: FAILED: the plan deviates more than 1.5x")


def _rank(rank, skipped, scales):
    return RankResult(rank=rank, pipeline=rank, stage=0, tensor_rank=0, losses=[1.0] * 3,
                      step_times=[0.1] * 3, skipped=skipped, loss_scales=scales)


def test_rank_disagreement_names_the_step_and_ranks():
    agree = [_rank(0, [True, False, False], [8.0, 8.0, 8.0]),
             _rank(1, [True, False, False], [8.0, 8.0, 8.0])]
    result = TrainResult(losses=[1.0] * 3, eval_loss=None, params={}, step_times={},
                         ranks=agree)
    assert rank_disagreement(result) is None
    result.ranks[1] = _rank(1, [True, True, False], [8.0, 4.0, 4.0])
    assert rank_disagreement(result) == "step 1: rank 0 stepped, rank 1 skipped"
    result.ranks[1] = _rank(1, [True, False, False], [8.0, 8.0, 16.0])
    assert rank_disagreement(result) == "step 2: loss scale 8.0 on rank 0, 16.0 on rank 1"


def test_verdict_needs_both_parts_within_tolerance_and_agreement():
    base = Deviation(loss=1e-4, params=1e-3)
    verdict = functools.partial(PrecisionVerdict, precision="fp16", optimizer="sgd", steps=3,
                                baseline=base, baseline_world_size=1)
    assert verdict(plan=Deviation(loss=1.5e-4, params=1.5e-3)).ok
    assert not verdict(plan=Deviation(loss=1.6e-4, params=1e-3)).ok
    assert not verdict(plan=Deviation(loss=1e-4, params=1.6e-3)).ok
    assert not verdict(plan=base, disagreement="step 0: ...").ok
    exact = verdict(plan=Deviation(loss=3.8e-8, params=3.9e-10))  # trained in fp32
    assert not exact.in_precision and not exact.ok
    assert "it did not train in fp16" in verdict_lines(exact, 3)[-1]
    assert verdict(plan=Deviation(loss=1e-6, params=1e-5)).ok  # rounds less, still 16-bit
    lines = verdict_lines(verdict(plan=base, skipped=[True, False], baseline_skipped=[True, True],
                                  loss_scales=[4.0, 4.0]), 4)
    assert "  fp16 loss scaling: this plan steps 0 skipped" in lines[3]
    assert lines[5].startswith("  note: the two skipped different steps")
    with pytest.raises(ValueError):
        Deviation(loss=math.nan, params=0.0)
    with pytest.raises(ValueError):
        verdict(plan=base, precision="fp32")


def test_fp16_initial_loss_scale_follows_the_tokens_of_a_micro_batch():
    assert fp16_initial_loss_scale(PLAN) == 32768.0  # 8 tokens: 4 x 65504 / 8 -> 2^15
    wide = tiny_plan([1, 5], [(4, 1)], seq_length=32)  # 128 tokens
    assert fp16_initial_loss_scale(wide) == 2048.0


@pytest.mark.slow
def test_rehearse_verify_of_an_fp16_plan_prints_what_it_compared(tmp_path, capsys, monkeypatch):
    """``rehearse --verify`` of an fp16 plan (replicas of 3 and 1 micro-batches on two GPU
    types): it prints the precision, the optimizer, both deviations and the loss scaling, and
    passes; with replica 1 reading wrong labels it fails, exit 1."""
    import yaml

    from megatron_hetero.cli import main
    from megatron_hetero.emulate import rehearse

    from .faults import hooks_with_wrong_labels

    model = {"name": "tiny", "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 688,
             "num_attention_heads": 8, "num_query_groups": 8, "vocab_size": 1000,
             "seq_length": 256}
    pipes = [(3, "A100-SXM-80GB"), (1, "V100-SXM2-32GB")]
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({
        "format_version": 1, "model": model, "global_batch_size": 4, "precision": "fp16",
        "tensor_model_parallel_size": 1,
        "pipelines": [{"micro_batch_size": 1, "num_microbatches": n,
                       "stages": [{"device_type": d, "num_layers": 4}]} for n, d in pipes]}))
    args = ["rehearse", str(path), "--steps", "2", "--hidden-size", "32", "--verify",
            "--calibration", str(tmp_path / "calibration.yaml")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "verify (fp16, sgd, 2 steps): deviation from the fp32 single-process run" in out
    assert "this plan (2 ranks, fp16)" in out and "plain Megatron's uniform plan (2 ranks" in out
    assert "every rank agreeing" in out
    assert "verify: the plan deviates no more than plain Megatron in fp16" in out
    monkeypatch.setattr(rehearse, "rehearsal_hooks",
                        functools.partial(hooks_with_wrong_labels, wrong_replica=1))
    assert main(args) == 1  # the calibration is read from the file the first run wrote
    out = capsys.readouterr().out
    assert "verify: FAILED: the plan deviates more than 1.5x plain Megatron's" in out
