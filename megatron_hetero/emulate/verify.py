"""``rehearse --verify``: the rehearsed plan against training in one process.

* An fp32 plan must match one process exactly (:func:`.trainer.compare_results`, rtol 1e-5,
  atol 1e-5): the runs differ only in the order of fp32 sums.
* A bf16 or fp16 plan trains in its own precision (megatron-core's mixed precision: bf16 or
  fp16 parameters and activations, gradients reduced in fp32, fp32 main parameters in the
  optimizer; fp16 with dynamic loss scaling), and 16-bit rounding makes it differ from any fp32
  run. The criterion (issue 33): its deviation from an fp32 one-process run is no larger than
  plain Megatron's uniform plan's in the same precision (:func:`uniform_plan`, no hooks, the
  same loss over tokens), within :data:`DEVIATION_TOLERANCE`; and with fp16 every rank of the
  plan agrees, step by step, on a found overflow (a skipped step) and on the loss scale. Both
  deviations are measured here, side by side (:class:`PrecisionVerdict`).

A deviation (:class:`Deviation`) has two parts: the largest relative difference of a step's
loss (every step and the forward-only pass after training), and the relative L2 distance of all
the final parameters together (an element's rounding to 16 bits differs between runs by one
ulp here and there, which the whole model's norm averages out, where one element's largest
difference would not).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..plan import Plan
from .trainer import TrainConfig, compare_results, reference_plan, train_plan

__all__ = ["Deviation", "PrecisionVerdict", "DEVIATION_TOLERANCE", "EXACT_FRACTION", "deviation",
           "uniform_plan", "fp16_initial_loss_scale", "rank_disagreement", "train_and_verify",
           "verdict_lines"]

DEVIATION_TOLERANCE = 1.5
"""How much larger than plain Megatron's the plan's deviation may be: the same factor
``tests/runtime/test_mixed_precision.py`` allows Megatron's own loop (measured there and here:
equal to 3 digits for an uneven plan of replicas 3:1 in bf16 and in fp16). A replica that
reads wrong labels from step 1 on deviates 100x more (``tests/emulate/test_verify_precision.py``)."""

FP16_MAX = 65504.0


@dataclass(kw_only=True, slots=True)
class Deviation:
    """How far a run is from the fp32 one-process run."""

    loss: float
    """Largest relative difference of a step's loss (and of the forward-only loss after
    training)."""
    params: float
    """Relative L2 distance of all the final parameters together."""

    def __post_init__(self) -> None:
        if not (self.loss >= 0 and self.params >= 0):  # NaN fails too
            raise ValueError(f"deviations are non-negative numbers, got {self.loss}, "
                             f"{self.params}")

    def within(self, baseline: "Deviation", tolerance: float) -> bool:
        """Both parts at most ``tolerance`` times ``baseline``'s."""
        return (self.loss <= tolerance * baseline.loss
                and self.params <= tolerance * baseline.params)


EXACT_FRACTION = 0.01
"""Below this fraction of plain Megatron's parameter deviation, a 16-bit plan did not round as
a 16-bit run does (:attr:`PrecisionVerdict.in_precision`)."""


@dataclass(kw_only=True, slots=True)
class PrecisionVerdict:
    """What a bf16 or fp16 ``--verify`` compared, and its outcome."""

    precision: str
    """The plan's precision, which the plan and plain Megatron's uniform plan trained in."""
    optimizer: str
    """The optimizer of all three runs (``sgd`` or ``adam``)."""
    steps: int
    """Training steps of each run."""
    plan: Deviation
    """The plan's deviation from the fp32 one-process run."""
    baseline: Deviation
    """Plain Megatron's uniform plan's (:func:`uniform_plan`), in the same precision."""
    baseline_world_size: int
    """Ranks of the uniform plan (its data and tensor parallelism)."""
    tolerance: float = DEVIATION_TOLERANCE
    """How many times plain Megatron's deviation the plan's may be."""
    skipped: list[bool] = field(default_factory=list)
    """Per step, the plan skipped it (fp16: an overflow), every rank agreeing."""
    baseline_skipped: list[bool] = field(default_factory=list)
    """Per step, plain Megatron's uniform plan skipped it."""
    loss_scales: list[float] = field(default_factory=list)
    """The plan's loss scale after each step (fp16)."""
    disagreement: str | None = None
    """Ranks of the plan that disagreed on a skipped step or a loss scale (None: all agreed)."""

    def __post_init__(self) -> None:
        if self.precision not in ("bf16", "fp16"):
            raise ValueError(f"a precision verdict is for bf16 or fp16, got {self.precision!r}")
        if self.tolerance < 1:
            raise ValueError(f"tolerance must be at least 1, got {self.tolerance}")

    @property
    def in_precision(self) -> bool:
        """The plan's run deviates as a 16-bit run does: its parameters at least
        :data:`EXACT_FRACTION` of plain Megatron's deviation (a plan that deviates far less
        trained in fp32, whatever it was asked: such a run once passed, its rank built in
        fp32, 3.9e-10 against plain Megatron's 2.5e-4)."""
        return self.plan.params >= EXACT_FRACTION * self.baseline.params

    @property
    def ok(self) -> bool:
        """The ranks agreed, the plan ran in its precision and both deviations are within
        ``tolerance`` of the baseline's."""
        return (self.disagreement is None and self.in_precision
                and self.plan.within(self.baseline, self.tolerance))


def deviation(result, reference) -> Deviation:
    """:class:`Deviation` of ``result`` from ``reference`` (two ``TrainResult`` of the same
    steps, the reference's parameters fp32)."""
    import torch

    losses = list(zip(result.losses, reference.losses))
    if reference.eval_loss is not None and result.eval_loss is not None:
        losses.append((result.eval_loss, reference.eval_loss))
    loss = max((abs(a - b) / abs(b) for a, b in losses), default=0.0)
    num = den = 0.0
    for name, ref in reference.params.items():
        got = result.params[name].to(torch.float64)
        num += float(((got - ref.to(torch.float64)) ** 2).sum())
        den += float((ref.to(torch.float64) ** 2).sum())
    return Deviation(loss=loss, params=math.sqrt(num / den) if den else 0.0)


def uniform_plan(plan: Plan) -> Plan:
    """Plain Megatron's uniform plan of ``plan``'s model and global batch: one stage, the
    data-parallel size of ``plan``'s first mesh with every replica alike (each its equal share
    of the global batch, in micro-batches of the one-process reference's size,
    :func:`.trainer.reference_plan`; one replica where the batch does not split so), and the
    largest tensor parallelism of ``plan``'s meshes (16-bit tensor-parallel reductions round
    too, so the baseline rounds at least as the plan's widest stage does)."""
    ref = reference_plan(plan)
    tp = max(m.tensor_model_parallel_size for m in plan.meshes)
    pipe = ref.meshes[0].pipelines[0]
    d = plan.meshes[0].data_parallel_size
    if pipe.num_microbatches % d:
        d = 1
    replica = dataclasses.replace(pipe, num_microbatches=pipe.num_microbatches // d)
    mesh = dataclasses.replace(ref.meshes[0], tensor_model_parallel_size=tp,
                               pipelines=[replica] * d)
    return dataclasses.replace(ref, meshes=[mesh])


def fp16_initial_loss_scale(plan: Plan) -> float:
    """The fp16 rehearsal's first loss scale: the power of two at or above 4 x fp16's largest
    number over the tokens of the plan's largest micro-batch. With the loss summed over tokens
    the output layer's scaled gradient sums that many terms of up to the scale each, so the
    first steps overflow and are skipped and the scale, halved after each (the rehearsal's
    hysteresis is 1), trains: a few steps run a skip as a real run's start does. Measured: the
    tests' tiny model (8 tokens a micro-batch) overflows at 16384 and trains at 8192, so it
    skips steps 0 and 1 from 32768; the rehearsal's model of hidden size 32 shrunk from the
    tests' 256 (32 tokens) trains at 4096."""
    tokens = max(p.micro_batch_size for m in plan.meshes for p in m.pipelines) \
        * plan.model.seq_length
    return 2.0 ** math.ceil(math.log2(4 * FP16_MAX / tokens))


def rank_disagreement(result) -> str | None:
    """The first step at which the ranks of ``result`` (a ``TrainResult``) disagree on skipping
    the step or on the loss scale after it, as a sentence; None when all agree."""
    first = result.ranks[0]
    for r in result.ranks[1:]:
        for step, (a, b) in enumerate(zip(first.skipped, r.skipped)):
            if a != b:
                return (f"step {step}: rank {first.rank} {'skipped' if a else 'stepped'}, "
                        f"rank {r.rank} {'skipped' if b else 'stepped'}")
        for step, (a, b) in enumerate(zip(first.loss_scales, r.loss_scales)):
            if a != b:
                return f"step {step}: loss scale {a} on rank {first.rank}, {b} on rank {r.rank}"
    return None


def train_and_verify(plan: Plan, config: TrainConfig, *, hooks, verify: bool, say, train=None):
    """Train ``plan`` (``train(plan, config, hooks)``: the rehearsal's run on CPU ranks, its
    caps and hooks) and, with ``verify``, check it against one process. ``config.precision``
    fp32: :func:`.trainer.compare_results` with :func:`.trainer.reference_plan`; bf16 or fp16:
    the fp32 one-process run and plain Megatron's uniform plan in the same precision, and
    their :class:`PrecisionVerdict`. Returns (result, first divergence of an fp32 plan or None,
    verdict of a 16-bit plan or None)."""
    train = train or (lambda p, c, h: train_plan(p, c, hooks_factory=h))
    result = train(plan, config, hooks)
    if not verify:
        return result, None, None
    if config.precision == "fp32":
        say("training the same model, data and seed in one process")
        ref = train_plan(reference_plan(plan), config)
        # atol: 1% of one Adam step (lr 1e-3); see tests/emulate/test_equivalence.py
        return result, compare_results(result, ref, rtol=1e-5, atol=1e-5), None
    say("training the same model, data and seed in one process in fp32, and plain Megatron's "
        f"uniform plan in {config.precision}")
    ref = train_plan(reference_plan(plan), dataclasses.replace(config, precision="fp32"))
    uniform = uniform_plan(plan)
    base = train_plan(uniform, config)
    verdict = PrecisionVerdict(
        precision=config.precision, optimizer=config.optimizer, steps=config.steps,
        plan=deviation(result, ref), baseline=deviation(base, ref),
        baseline_world_size=uniform.world_size, skipped=list(result.ranks[0].skipped),
        baseline_skipped=list(base.ranks[0].skipped),
        loss_scales=list(result.ranks[0].loss_scales),
        disagreement=rank_disagreement(result))
    return result, None, verdict


def _steps(skipped: list[bool]) -> str:
    hit = [str(k) for k, s in enumerate(skipped) if s]
    return f"steps {', '.join(hit)} skipped" if hit else "no step skipped"


def verdict_lines(verdict: PrecisionVerdict, world_size: int) -> list[str]:
    """What ``rehearse --verify`` prints of a 16-bit plan's verdict."""
    v = verdict
    lines = [f"verify ({v.precision}, {v.optimizer}, {v.steps} steps): deviation from the fp32 "
             "single-process run (largest relative loss difference; relative L2 of the final "
             "parameters):",
             f"  this plan ({world_size} ranks, {v.precision})          loss {v.plan.loss:.3g}"
             f"  params {v.plan.params:.3g}",
             f"  plain Megatron's uniform plan ({v.baseline_world_size} rank"
             f"{'s' if v.baseline_world_size > 1 else ''}, {v.precision})  "
             f"loss {v.baseline.loss:.3g}  params {v.baseline.params:.3g}"]
    if v.precision == "fp16":
        lines.append(f"  fp16 loss scaling: this plan {_steps(v.skipped)} (loss scale after each "
                     f"step {', '.join(f'{s:g}' for s in v.loss_scales)}), every rank agreeing"
                     if v.disagreement is None else
                     f"  fp16 loss scaling: the ranks disagree: {v.disagreement}")
        lines.append(f"  plain Megatron's uniform plan: {_steps(v.baseline_skipped)}")
        if v.skipped != v.baseline_skipped:
            lines.append("  note: the two skipped different steps (their micro-batches, or the "
                         "loss over tokens against a chain's mean, overflow at different loss "
                         "scales): the deviations compare runs that trained different steps")
    if v.ok:
        lines.append(f"verify: the plan deviates no more than plain Megatron in {v.precision} "
                     f"(within {v.tolerance:g}x of its deviation)")
    else:
        lines.append("verify: FAILED: the plan's ranks disagree on fp16 loss scaling"
                     if v.disagreement is not None else
                     f"verify: FAILED: the plan deviates less than {EXACT_FRACTION:g}x plain "
                     f"Megatron's uniform plan: it did not train in {v.precision}"
                     if not v.in_precision else
                     f"verify: FAILED: the plan deviates more than {v.tolerance:g}x plain "
                     f"Megatron's uniform plan in {v.precision}")
    return lines
