"""The plan's implied Megatron arguments, checked against the user's command line and applied.

``megatron_hetero.plan.megatron_args`` lists what a plan implies (parallel sizes, layer split, model
shape, batch sizes, precision). Here each implied argument is compared with the parsed Megatron
arguments: one the user gave with another value is a conflict (one error listing every
conflict); one the user left out is filled in from the plan. Arguments the plan does not govern
pass through untouched.

An interleaved plan (``virtual_pipeline_size`` v > 1) implies ``--pipeline-model-parallel-layout``
with p x v segments, from which Megatron takes its virtual pipeline size; the virtual-stage flags
are accepted only where they say the same, and dropped (Megatron takes one of them and the
layout). Its ``microbatch_group_size``, when set, implies
``--microbatch-group-size-per-virtual-pipeline-stage``; when unset, that flag is accepted only
with Megatron's default (the pipeline size), which the plan was predicted with.

Per-rank settings (micro-batches, recompute, offload) are not command-line arguments; see
:mod:`megatron_hetero.runtime.hooks`. The command line may not set them either (the
``--recompute-*`` options unless every stage shares them, ``--fine-grained-activation-offloading``
and ``--offload-modules`` always): each is a conflict naming the plan field that governs it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import HeteroError
from ..plan.megatron_args import GROUP_FLAG, megatron_args
from ..plan import Plan

__all__ = ["Implied", "implied_arguments", "implied_from_tokens", "given_flags",
           "check_and_apply", "ArgumentConflict", "virtual_micro_batch_size"]

# Flags whose value is a number; everything else with a value is a string.
_STORE_FALSE = {"--disable-bias-linear": "add_bias_linear"}
_AT_LEAST = {"--max-position-embeddings"}  # the user may allow longer positions than the plan
_SPLIT_FLAGS = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                "--pipeline-model-parallel-layout")
_VIRTUAL_FLAGS = ("--num-layers-per-virtual-pipeline-stage",
                  "--num-virtual-stages-per-pipeline-rank")
_MODULE_INPUT_FLAGS = ("--fine-grained-activation-offloading", "--offload-modules")
_GOVERNED_ELSEWHERE = {
    # flag the plan governs but does not imply -> why
    "--rampup-batch-size": "the plan fixes every replica's micro-batches",
    "--fp16": None, "--bf16": None,  # precision: checked against the plan's
}


class ArgumentConflict(HeteroError):
    """The command line contradicts the plan."""


@dataclass(frozen=True, slots=True)
class Implied:
    """One argument the plan implies."""

    flag: str
    dest: str
    value: Any


_DESTS = {GROUP_FLAG: "microbatch_group_size_per_vp_stage"}  # Megatron's own attribute names


def _dest(flag: str) -> str:
    return _DESTS.get(flag) or flag[2:].replace("-", "_")


def _typed(text: str) -> Any:
    """A token's value as Megatron's parser leaves it: an integer, a list where the plan writes
    a list expression (``--moe-layer-freq "([0,1,1])"``, which Megatron evaluates), else the
    text."""
    try:
        return int(text)
    except ValueError:
        pass
    if text.startswith(("(", "[")):
        value = ast.literal_eval(text)
        if isinstance(value, list):
            return value
    return text


def implied_arguments(plan: Plan) -> list[Implied]:
    """The plan's implied arguments as (flag, Megatron ``args`` attribute, value)."""
    return implied_from_tokens(megatron_args(plan))


def implied_from_tokens(tokens: Sequence[str]) -> list[Implied]:
    """Megatron arguments (``--flag [value]`` tokens) as (flag, ``args`` attribute, value)."""
    out: list[Implied] = []
    i = 0
    while i < len(tokens):
        flag = tokens[i]
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            out.append(Implied(flag, _dest(flag), _typed(tokens[i + 1])))
            i += 2
        else:
            if flag in _STORE_FALSE:
                out.append(Implied(flag, _STORE_FALSE[flag], False))
            else:
                out.append(Implied(flag, _dest(flag), True))
            i += 1
    return out


def given_flags(argv: Sequence[str]) -> set[str]:
    """Option names present on a command line (``--x 1`` and ``--x=1`` alike)."""
    return {tok.split("=", 1)[0] for tok in argv if tok.startswith("--")}


def virtual_micro_batch_size(plan: Plan) -> int:
    """The ``--micro-batch-size`` Megatron's own step accounting sees for an uneven plan.

    Megatron counts a step as ``micro_batch_size x data_parallel_size x num_microbatches``
    samples on every rank. The runtime keeps that count equal to the plan's global batch size
    (so consumed samples, learning-rate schedule and tokens/s are the real totals) while each
    replica runs its own micro-batches. Raises when no such size exists.
    """
    dp, gbs = plan.data_parallel_size, plan.global_batch_size
    for m in (plan.pipelines[0].micro_batch_size, 1):
        if gbs % (m * dp) == 0:
            return m
    raise ArgumentConflict(
        f"global_batch_size {gbs} is not a multiple of the data-parallel size {dp}: Megatron's "
        f"step accounting (micro-batch size x DP x micro-batches) cannot equal it; the runtime "
        f"needs a global batch size divisible by the number of pipelines")


def _check_virtual(args, plan: Plan, given: set[str], conflict) -> None:
    """Virtual pipeline stages come from the plan (through its layout string). A virtual-stage
    flag that agrees with the plan is dropped (Megatron takes one of the flag and the layout)."""
    v, chunks = plan.virtual_pipeline_size, plan.virtual_stage_layers
    what = (f"virtual_pipeline_size {v} (layout {plan.layout()!r})" if v > 1
            else "no virtual pipeline stages")
    for flag in _VIRTUAL_FLAGS:
        value = getattr(args, _dest(flag), None)
        if flag not in given or value is None:
            continue
        if flag == "--num-virtual-stages-per-pipeline-rank":
            agrees = value == v
        else:  # layers per virtual stage: only an even split of chunks says the same
            agrees = set(chunks) == {value}
        if agrees:
            setattr(args, _dest(flag), None)
        else:
            conflict(flag, value, f"{what}; leave it out")
    group = getattr(args, _dest(GROUP_FLAG), None)
    if (GROUP_FLAG in given and plan.microbatch_group_size is None and group is not None
            and not (v > 1 and group == plan.pipeline_model_parallel_size)):
        conflict(GROUP_FLAG, group,
                 f"Megatron's default group (the {plan.pipeline_model_parallel_size} pipeline "
                 "stages; the plan's microbatch_group_size is unset)" if v > 1
                 else "nothing (the plan does not interleave)")
    if (v > 1 and plan.pipeline_model_parallel_size == 2
            and "--no-overlap-p2p-communication" in given):
        conflict("--no-overlap-p2p-communication", True,
                 "overlapped p2p communication (Megatron's interleaved schedule on 2 pipeline "
                 "stages needs it)")


def check_and_apply(args, plan: Plan, argv: Sequence[str], *, source: str = "plan") -> None:
    """Check the parsed Megatron ``args`` (from ``argv``) against ``plan``; fill in what the
    user left out. Raises :class:`ArgumentConflict` listing every conflict."""
    given = given_flags(argv)
    implied = implied_arguments(plan)
    conflicts: list[str] = []

    def conflict(flag: str, found: Any, expected: str) -> None:
        conflicts.append(f"  {flag}: the command line has {found!r}; the plan implies {expected}")

    implied_flags = {i.flag for i in implied}
    # The layer split: the user may give the plan's layout string instead of first/last counts.
    user_layout = getattr(args, "pipeline_model_parallel_layout", None)
    if "--pipeline-model-parallel-layout" in given and isinstance(user_layout, str):
        if user_layout.replace(" ", "") != plan.layout():
            conflict("--pipeline-model-parallel-layout", user_layout, repr(plan.layout()))
        implied = [i for i in implied if i.flag not in _SPLIT_FLAGS]
        implied_flags -= set(_SPLIT_FLAGS)
        given = given - {"--pipeline-model-parallel-layout"}
    for flag in _SPLIT_FLAGS:
        if flag in given and flag not in implied_flags:
            conflict(flag, getattr(args, _dest(flag), None),
                     f"no such option (the plan's split {plan.layer_split} is "
                     + (f"layout {plan.layout()!r})" if plan.pipeline_model_parallel_size > 1
                        else "one stage)"))
    if any(i.flag == "--pipeline-model-parallel-layout" for i in implied) and not hasattr(
            args, "pipeline_model_parallel_layout"):
        raise ArgumentConflict(
            f"{source}: the layer split {plan.layer_split} needs --pipeline-model-parallel-layout "
            f"(megatron-core >= 0.13), which this Megatron does not have; it cannot be expressed "
            f"with first/last stage counts")
    _check_virtual(args, plan, given, conflict)
    for flag, why in _GOVERNED_ELSEWHERE.items():
        if flag in given and why is not None and getattr(args, _dest(flag), None) not in (None, 1):
            conflict(flag, getattr(args, _dest(flag)), f"nothing ({why})")
    if "--fp16" in given and plan.precision != "fp16":
        conflict("--fp16", True, f"precision {plan.precision}")
    if "--bf16" in given and plan.precision != "bf16":
        conflict("--bf16", True, f"precision {plan.precision}")
    # Recompute: the plan governs it per stage.
    for flag in ("--recompute-granularity", "--recompute-method", "--recompute-num-layers"):
        if flag in given and flag not in implied_flags:
            conflict(flag, getattr(args, _dest(flag), None),
                     "per-stage recompute from the plan (leave the --recompute-* options out)")
    # Module-input offload (fine-grained activation offloading): per stage too.
    for flag in _MODULE_INPUT_FLAGS:
        if flag in given:
            conflict(flag, getattr(args, _dest(flag), None),
                     "per-stage module-input offload from the plan (offload.module_inputs; "
                     "leave the option out)")

    for item in implied:
        if item.flag == "--hetero-plan":
            continue
        if item.flag == "--micro-batch-size" and not plan.uniform_data_parallel:
            continue  # replicas differ; set below
        current = getattr(args, item.dest, None)
        if item.flag in given:
            if item.flag in _AT_LEAST:
                if current is None or current < item.value:
                    conflict(item.flag, current, f"at least {item.value}")
                continue
            if current != item.value:
                conflict(item.flag, current, repr(item.value))
            continue
        setattr(args, item.dest, item.value)
    if not plan.uniform_data_parallel:
        virtual = virtual_micro_batch_size(plan)
        sizes = sorted({p.micro_batch_size for p in plan.pipelines} | {virtual})
        if "--micro-batch-size" in given and args.micro_batch_size not in sizes:
            conflict("--micro-batch-size", args.micro_batch_size,
                     f"one of {sizes} (each replica runs its own from the plan)")
        args.micro_batch_size = virtual
    if conflicts:
        raise ArgumentConflict(f"{source}: the command line contradicts the plan:\n"
                               + "\n".join(conflicts))
