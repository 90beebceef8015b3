"""A mini trainer: real megatron-core training of a plan on CPU processes.

It is the execution engine of the equivalence tests and of ``rehearse`` (its ranks and its
calibration). Each process plays one Megatron rank of a :class:`~megatron_hetero.plan.Plan` of
any shape: the rank's megatron-core machinery is a :mod:`.rank_backends` backend chosen by the
plan's shape (megatron-core's own schedules on one grid, the multimodule communicator over a
chain of meshes); the data, the steps, the hooks, the reference and the merge are this
module's, the same for both.

Public API
----------
``TrainConfig``
    Steps, seed, optimizer settings, timeouts.
``RankHooks``
    Hook points of one rank: ``compute(kind)`` is a context manager wrapped around every
    forward (``kind="forward"``) and backward (``"backward"``) micro-batch step of that rank
    (the real work only: no communication inside; speed emulation measures and sleeps there);
    ``on_step_end(step, wall_s)``; ``report()`` whose value comes back in ``RankResult.extra``;
    ``on_built(model_chunks, optimizer)`` once before the first step; ``on_step_start(step)``;
    ``around(kind, original, ...)`` around megatron-core's ``schedules.forward_step`` and
    ``backward_step`` (the telemetry's marks); ``plan_at(step)``, the plan a step runs where
    live rebalancing moved the replicas' shares (:mod:`.telemetry`).
``train_rank(plan, rank, config, hooks=None) -> RankResult``
    Run inside a process of a gloo group of ``plan.world_size`` (see
    :mod:`megatron_hetero.mcore.spawn`); enables the CPU backend (and its offload fixes,
    :mod:`megatron_hetero.mcore.cpu_offload`), builds the rank through its backend
    (:func:`.rank_backends.backend_for`): a ``GPTModel`` (local spec, fp32, CPU initialization,
    this stage's recompute and module-input offload), Megatron's DDP
    (``plan.overlap_grad_reduce``) and optimizer (Adam or SGD, grad clipping; distributed as
    :meth:`TrainConfig.distributed_optimizer` says; the stage's optimizer offload), and runs
    ``config.steps`` steps of the backend's schedule, then one forward-only pass.
    The ranks train in ``config.precision`` (fp32 by default, whatever ``plan.precision``
    says; bf16 or fp16: megatron-core's mixed precision, fp32 main parameters in the
    optimizer, fp16 with its dynamic loss scaling). ``RankResult.pipeline`` is the rank's
    replica in its mesh, ``RankResult.stage`` its stage in the whole pipeline.
``train_plan(plan, config, hooks_factory=None) -> TrainResult``
    Spawns ``plan.world_size`` CPU processes running :func:`train_rank` and merges their
    results: the global loss per step, the forward-only loss after training, every parameter
    under a layout-independent name (TP shards gathered, :mod:`.params`), and the wall time per
    step of each rank. ``hooks_factory(plan, rank) -> RankHooks`` is called in each rank (it
    must be importable by name, e.g. a module-level function or a ``functools.partial`` of one).
``reference_plan(plan) -> Plan``
    The same model and global batch on one process: one stage, one pipeline, its micro-batch
    the unit of the plan's data order. Comparing
    ``train_plan(plan)`` with ``train_plan(reference_plan(plan))`` is the equivalence check.
``with_tiny_model(plan, ...) -> Plan`` (explicit tiny sizes; the rehearsal's ``shrink_model`` keeps the model's ratios)
    The plan with a model narrow enough for CPUs: same layer count and split, same pipelines.
``compare_results(a, b, rtol, atol) -> str | None``
    The first step or tensor where two results diverge, or None.
``sample_tokens(index, ...)``, ``micro_batches(plan, slot, step, seed)``
    The synthetic dataset: one sample, and one replica's micro-batches of one step.

Training semantics
------------------
Each step, a replica runs its own ``num_microbatches`` micro-batches of its own
``micro_batch_size``. Sample ``i`` (global index ``step * global_batch_size + position``) is
``seq_length + 1`` tokens drawn from a generator seeded with ``(seed, i)``. Which positions a
replica reads (:func:`sample_index`): its own consecutive share of the global batch
(:func:`share_offset`, the replicas in data-parallel rank order, as the runtime's sampler
reads them), except in a chain of meshes whose replicas are alike: there micro-batch ``m`` of
a step is positions ``m B .. (m + 1) B - 1`` (``B = D x micro_batch_size``, the same in every
mesh), replica ``r`` taking rows ``r b .. (r + 1) b - 1`` of it, the order in which a bridge
joins and splits them between meshes of different data-parallel sizes. On one grid
``calculate_per_token_loss`` makes the loss a sum, and ``finalize_model_grads`` divides the
gradients by the tokens of the whole global batch, so uneven replicas are exact (a chain of
meshes uses the per-token loss where its replicas differ, a gradient scale otherwise). The
global loss of a step is sum of token losses / tokens, over all replicas. Parameters are
initialized from a generator seeded by their layout-independent name, so any plan of the same
model starts from the same weights.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Literal

from ..mcore.cpu_offload import enable_cpu_offload
from ..plan import Mesh, ModelSpec, Pipeline, Plan, Slot, Stage, replace_grid
from .data import micro_batches, rows_joined, sample_index, sample_tokens, share_offset
from .params import merge_params
from .rank_backends import backend_for

__all__ = ["TrainConfig", "RankHooks", "RankResult", "TrainResult", "train_rank", "train_plan",
           "reference_plan", "with_tiny_model", "compare_results", "sample_tokens",
           "micro_batches", "sample_index", "share_offset", "rows_joined", "forward_step",
           "train_steps"]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """How the mini trainer trains (the model and batch come from the plan)."""

    steps: int = 3
    """Optimizer steps to run."""
    seed: int = 1234
    """Seed of the synthetic data and of the parameter initialization."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Megatron's optimizer. Adam divides each update by the gradient's running magnitude, so
    an element whose gradient nearly cancels turns fp32 rounding (which differs between plans)
    into a visible parameter difference; SGD (momentum 0.9) is linear in the gradient, so plans
    agree to rounding: use it for tight equivalence checks over many micro-batches."""
    lr: float = 1e-3
    """Learning rate (constant)."""
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold (0 disables)."""
    init_std: float = 0.02
    """Standard deviation of the initial weight matrices."""
    use_distributed_optimizer: bool | None = False
    """Megatron's distributed optimizer (optimizer state sharded over data parallelism; works
    on gloo); None follows ``plan.use_distributed_optimizer``. Default: the plain fp32 one."""
    gather_params: bool = True
    """Return the final parameters (TP shards gathered in ``train_plan``)."""
    eval_forward_only: bool = True
    """After the last step, run Megatron's forward-only schedule on the next global batch and
    return its loss (``eval_loss``)."""
    threads_per_rank: int = 1
    """torch intra-op threads of each rank process."""
    timeout_s: float = 300.0
    """Hard timeout of ``train_plan``'s processes."""
    offload_min_numel: int | None = None
    """Smallest tensor (elements) ``offload.module_inputs`` moves to the host (None: 1M)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """The precision the ranks train in: ``fp32``, or megatron-core's mixed precision (the model's
    parameters, activations and pipeline messages in bf16 or fp16, gradients reduced in fp32,
    fp32 main parameters in the optimizer; fp16 with dynamic loss scaling)."""
    initial_loss_scale: float = 2.0 ** 32
    """fp16: the dynamic loss scale's start (megatron-core's default); it halves after
    ``loss_scale_hysteresis`` overflowing steps and doubles after 1000 clean ones."""
    loss_scale_hysteresis: int = 2
    """fp16: overflowing steps before the loss scale first halves (megatron-core's default 2;
    Megatron-LM's ``--hysteresis``)."""

    def distributed_optimizer(self, plan) -> bool:
        """Whether ``plan`` (either format) trains with the distributed optimizer: the plan's
        choice where this says None or the plan offloads optimizer state (it runs under it)."""
        own = self.use_distributed_optimizer
        return plan.use_distributed_optimizer if own is None or plan.offloads_optimizer else own

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError("precision must be 'fp32', 'bf16' or 'fp16', got "
                             f"{self.precision!r}")
        if self.loss_scale_hysteresis < 1:
            raise ValueError("loss_scale_hysteresis must be at least 1, got "
                             f"{self.loss_scale_hysteresis}")
        if not 1.0 <= self.initial_loss_scale < math.inf:
            raise ValueError("initial_loss_scale must be a finite number >= 1, got "
                             f"{self.initial_loss_scale}")


@dataclass(kw_only=True, slots=True)
class RankHooks:
    """Hook points of one rank (all optional)."""

    compute: Callable[[str], ContextManager] | None = None
    """``compute(kind)`` wraps each forward (``"forward"``) and backward (``"backward"``)
    micro-batch step of this rank during training steps: real compute only, no communication
    inside (not the forward-only evaluation)."""
    on_step_end: Callable[[int, float], None] | None = None
    """Called after each step with the step index and this rank's wall seconds for it."""
    report: Callable[[], Any] | None = None
    """Its value at the end comes back as ``RankResult.extra``."""
    on_built: Callable[[list, Any], None] | None = None
    """Called once with the model chunks (``[DistributedDataParallel]``) and the optimizer,
    after they are built and before the first step."""
    on_step_start: Callable[[int], None] | None = None
    """Called before each step with the step index (0 is the first)."""
    around: Callable[..., Any] | None = None
    """``around(kind, original, *args, **kwargs)`` wraps each call of megatron-core's
    ``schedules.forward_step`` (``kind="forward"``) and ``backward_step`` (``"backward"``)
    during training steps and returns its value (the telemetry's marks:
    :class:`~megatron_hetero.telemetry.collect.RankCapture`)."""
    plan_at: Callable[[int], Plan] | None = None
    """The plan step ``step`` runs, where live rebalancing moved the replicas' micro-batch
    shares (one grid; the forward-only pass after training takes ``plan_at(steps)``); None: the
    plan throughout."""


@dataclass(kw_only=True, slots=True)
class RankResult:
    """What one rank returns."""

    rank: int
    pipeline: int
    stage: int
    tensor_rank: int
    losses: list[float]
    """Global loss per step (every rank gets it)."""
    eval_loss: float | None = None
    """Global loss of the forward-only pass after training (``TrainConfig.eval_forward_only``)."""
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norm per step (before clipping), as Megatron's optimizer computes it
    (NaN where fp16's step was skipped)."""
    skipped: list[bool] = field(default_factory=list)
    """Per step: the optimizer skipped it (fp16: a gradient overflowed on some rank)."""
    loss_scales: list[float] = field(default_factory=list)
    """Per step: the loss scale after the step (1.0 outside fp16)."""
    step_times: list[float]
    """Wall seconds of each step on this rank."""
    params: dict[str, tuple[Any, int | None, bool]] = field(default_factory=dict)
    """Local parameters: name -> (tensor, tensor-parallel partition dim or None, is fused GLU)."""
    extra: Any = None


@dataclass(kw_only=True, slots=True)
class TrainResult:
    """What :func:`train_plan` returns."""

    losses: list[float]
    eval_loss: float | None
    params: dict[str, Any]
    """Full parameters under layout-independent names (from data-parallel replica 0)."""
    step_times: dict[int, list[float]]
    """Wall seconds per step, per rank."""
    ranks: list[RankResult]


# -- plans ----------------------------------------------------------------------------------------
def reference_plan(plan: Plan) -> Plan:
    """One stage, one pipeline, TP=1, no interleaving, the plain (not distributed) optimizer,
    no overlapped gradient reduction: the same model and global batch on one process, in
    micro-batches of the plan's data order (:func:`rows_joined`: ``D x micro_batch_size``;
    otherwise the largest size that divides every replica's micro-batch)."""
    first = plan.meshes[0]
    if rows_joined(plan):
        mbs = first.data_parallel_size * first.pipelines[0].micro_batch_size
    else:
        mbs = math.gcd(*(p.micro_batch_size for p in first.pipelines))
    stage = Stage(device_type=first.pipelines[0].stages[0].device_type,
                  num_layers=plan.model.num_layers)
    return Plan(model=plan.model, global_batch_size=plan.global_batch_size,
                meshes=[Mesh(tensor_model_parallel_size=1, pipelines=[Pipeline(
                    micro_batch_size=mbs, num_microbatches=plan.global_batch_size // mbs,
                    stages=[stage])])],
                precision=plan.precision, use_distributed_optimizer=False,
                sequence_parallel=False, overlap_grad_reduce=False, virtual_pipeline_size=1,
                microbatch_group_size=None, gpus=dict(plan.gpus), prediction=None,
                catalog=plan.catalog)


def with_tiny_model(plan: Plan, *, hidden_size: int = 64, num_attention_heads: int = 4,
                 ffn_hidden_size: int | None = None, vocab_size: int = 128,
                 seq_length: int = 16) -> Plan:
    """The plan with a small model: same layer count and split, same pipelines and batch; an
    MoE model keeps its experts and routing, each expert (and the shared ones) ``ffn`` wide."""
    tp = plan.tensor_model_parallel_size
    m = plan.model
    groups = num_attention_heads if m.num_query_groups == m.num_attention_heads else tp
    ffn = ffn_hidden_size or 2 * hidden_size
    experts = {} if not m.is_moe else dict(
        num_experts=m.num_experts, moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=ffn,
        moe_shared_expert_intermediate_size=(
            None if m.moe_shared_expert_intermediate_size is None else ffn),
        moe_shared_expert_gate=m.moe_shared_expert_gate, moe_layer_freq=m.moe_layer_freq,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type)
    model = ModelSpec(name=f"{m.name}-shrunk", num_layers=m.num_layers, hidden_size=hidden_size,
                      ffn_hidden_size=ffn,
                      num_attention_heads=num_attention_heads, num_query_groups=groups,
                      vocab_size=vocab_size, seq_length=seq_length, swiglu=m.swiglu,
                      normalization=m.normalization,
                      position_embedding_type=m.position_embedding_type,
                      untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
                      add_bias_linear=m.add_bias_linear, **experts)
    return replace_grid(plan, model=model, precision="fp32")


# -- one rank -------------------------------------------------------------------------------------
_active: list[RankHooks | None] = [None]
"""The hooks of the steps this process is training (None outside them)."""


def _install_schedule_hooks() -> None:
    """Wrap megatron-core's ``schedules.forward_step`` and ``backward_step`` (and its
    multimodule twin) once for :attr:`RankHooks.around` and, on the backward,
    :attr:`RankHooks.compute`."""
    from megatron.core.pipeline_parallel import schedules
    for name, kind in (("forward_step", "forward"), ("backward_step", "backward"),
                       ("backward_step_multimodule", "backward")):
        original = getattr(schedules, name, None)
        if original is None or getattr(original, "_hetero_wrapped", False):
            continue
        setattr(schedules, name, _wrapped(original, kind))


def _wrapped(original, kind: str):
    @functools.wraps(original)
    def step(*args, **kwargs):
        hooks = _active[0]
        if hooks is None:
            return original(*args, **kwargs)
        call = original if kind == "forward" or hooks.compute is None else \
            functools.partial(_computed, hooks.compute, original)
        if hooks.around is not None:
            return hooks.around(kind, call, *args, **kwargs)
        return call(*args, **kwargs)

    step._hetero_wrapped = True
    return step


def _computed(compute, original, *args, **kwargs):
    with compute("backward"):
        return original(*args, **kwargs)


def _loss_func(loss_mask, output_tensor):
    import torch
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.float().view(1)])}


def forward_step(data_iterator, model_chunk):
    """The schedule's ``forward_step_func``: one micro-batch through ``model_chunk`` (inside
    ``RankHooks.compute("forward")`` while :func:`train_steps` trains) and its loss function."""
    batch = next(data_iterator)
    hooks = _active[0]  # RankHooks.compute while training, None in evaluation
    hook = hooks.compute if hooks is not None else None
    with hook("forward") if hook else contextlib.nullcontext():
        out = model_chunk(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return out, functools.partial(_loss_func, batch["loss_mask"])


def _freeze_heap() -> None:
    """Collect, then freeze every object alive (the model, the optimizer, megatron-core's and
    torch's modules) out of Python's cyclic garbage collector until ``gc.unfreeze()``.

    Without it the collector's first full collection during the steps walks that whole heap:
    200-250 ms of CPU on a CPU rank of a mesh plan (measured 2026-11-28 with ``gc.callbacks``,
    one per rank, in the first or second step after the warm-up), inside a forward or backward,
    where the speed emulation (:mod:`.speed`) takes it for the device's compute and stretches
    it by the device's factor (0.6-1.1 s), and the stages after it wait. A real rank's host
    pauses the same 0.2 s in steps of seconds; Megatron-LM's ``--manual-gc`` moves collections
    to step boundaries for the same jitter. Objects made during the steps are collected as usual."""
    gc.collect()
    gc.freeze()


@dataclass(kw_only=True, slots=True)
class _Steps:
    """What :func:`train_steps` measured."""

    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    eval_loss: float | None = None


def train_steps(run: Callable[[int, bool], float], ddps: list, optimizer, config: TrainConfig,
                hooks: RankHooks) -> _Steps:
    """``config.steps`` steps of ``run(step, forward_only)`` (one pass of the schedule over the
    step's micro-batches, returning the step's loss over the whole model) each followed by
    ``optimizer.step()``, with ``hooks.compute`` around every micro-batch's forward and backward
    and ``hooks.on_step_end`` after each step; then, with ``config.eval_forward_only``, one
    forward-only pass. Returns the losses, wall seconds, gradient norms, skips and loss scales
    of the steps, and the forward-only loss (None without it). The heap built before the steps
    is frozen while they run (:func:`_freeze_heap`)."""
    import torch

    _install_schedule_hooks()
    out = _Steps()
    losses, times, grad_norms = out.losses, out.times, out.grad_norms
    _active[0] = hooks
    _freeze_heap()
    try:
        for step in range(config.steps):
            if hooks.on_step_start:
                hooks.on_step_start(step)
            t0 = time.perf_counter()
            for ddp in ddps:
                ddp.zero_grad_buffer()
            optimizer.zero_grad()
            loss = run(step, False)
            ok, grad_norm, _zeros = optimizer.step()
            assert ok or config.precision == "fp16", "the optimizer step reported failure"
            out.skipped.append(not ok)  # fp16: an overflow anywhere, every rank agreeing
            out.loss_scales.append(float(optimizer.get_loss_scale()))
            losses.append(loss)
            grad_norms.append(math.nan if grad_norm is None else float(grad_norm))
            times.append(time.perf_counter() - t0)
            if hooks.on_step_end:
                hooks.on_step_end(step, times[-1])
    finally:
        _active[0] = None
        gc.unfreeze()
    if config.eval_forward_only:
        for ddp in ddps:
            ddp.eval()
        with torch.no_grad():
            out.eval_loss = run(config.steps, True)
        for ddp in ddps:
            ddp.train()
    return out


def train_rank(plan: Plan, rank: int, config: TrainConfig | None = None,
               hooks: RankHooks | None = None) -> RankResult:
    """Train ``plan`` as Megatron rank ``rank`` (see the module docstring). The default gloo
    process group of ``plan.world_size`` ranks must be initialized."""
    import torch.distributed as dist

    from ..mcore.cpu_backend import enable_cpu_backend

    config = config or TrainConfig()
    hooks = hooks or RankHooks()
    enable_cpu_backend()
    if plan.offloads_optimizer or plan.offloads_module_inputs:
        enable_cpu_offload()  # megatron-core's offload paths on the CPU backend
    if dist.get_world_size() != plan.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks; the plan needs "
                         f"{plan.world_size}")
    slot = plan.slot_of_rank(rank)
    with backend_for(plan).open(plan, slot, config) as backend:
        if hooks.on_built:
            hooks.on_built(backend.ddps, backend.optimizer)

        def run(step: int, forward_only: bool) -> float:
            now = hooks.plan_at(step) if hooks.plan_at else plan  # the step's shares
            # looked up at each step: a test's hooks may replace this module's micro_batches
            batches = functools.partial(micro_batches, now, slot, step, config.seed)
            return backend.run(batches, forward_step, forward_only,
                               plan=None if now is plan else now)

        done = train_steps(run, backend.ddps, backend.optimizer, config, hooks)
        params = backend.params() if config.gather_params else {}
        return RankResult(rank=rank, pipeline=slot.replica, stage=plan.global_stage(slot),
                          tensor_rank=slot.tensor_rank, losses=done.losses,
                          eval_loss=done.eval_loss, grad_norms=done.grad_norms,
                          skipped=done.skipped, loss_scales=done.loss_scales,
                          step_times=done.times, params=params,
                          extra=hooks.report() if hooks.report else None)


def _rank_entry(rank: int, world_size: int, plan, config: TrainConfig,
                hooks_factory) -> RankResult:
    hooks = hooks_factory(plan, rank) if hooks_factory else None
    return train_rank(plan, rank, config, hooks)


def train_plan(plan: Plan, config: TrainConfig | None = None,
               hooks_factory: Callable[[Plan, int], RankHooks] | None = None,
               env: dict[str, str] | None = None) -> TrainResult:
    """Train ``plan`` on ``plan.world_size`` CPU processes running :func:`train_rank`,
    ``hooks_factory(plan, rank)`` making each rank's hooks, and merge what they return: rank
    0's losses, every parameter under its layout-independent name (from replica 0 of each mesh,
    tensor-parallel shards joined; with ``config.gather_params``), every rank's step times."""
    from ..mcore.spawn import spawn

    config = config or TrainConfig()
    ranks = spawn(_rank_entry, plan.world_size, args=(plan, config, hooks_factory),
                  timeout_s=config.timeout_s, threads_per_rank=config.threads_per_rank, env=env)
    params = merge_params(plan, ranks) if config.gather_params else {}
    return TrainResult(losses=ranks[0].losses, eval_loss=ranks[0].eval_loss, params=params,
                       step_times={r.rank: r.step_times for r in ranks}, ranks=ranks)


def compare_results(result: TrainResult, reference: TrainResult, *, rtol: float = 1e-5,
                    atol: float = 0.0) -> str | None:
    """The first divergence between two results (losses by step, then parameters by name), as
    a sentence; None when they agree within ``|a - b| <= atol + rtol * |b|``."""
    import torch
    for step, (a, b) in enumerate(zip(result.losses, reference.losses)):
        if not abs(a - b) <= atol + rtol * abs(b):
            return f"step {step}: loss {a!r} vs reference {b!r}"
    if len(result.losses) != len(reference.losses):
        return f"{len(result.losses)} steps vs reference {len(reference.losses)}"
    a, b = result.eval_loss, reference.eval_loss
    if (a is None) != (b is None) or (a is not None and not abs(a - b) <= atol + rtol * abs(b)):
        return f"forward-only loss after training: {a!r} vs reference {b!r}"
    if set(result.params) != set(reference.params):
        only_a = sorted(set(result.params) - set(reference.params))
        only_b = sorted(set(reference.params) - set(result.params))
        return f"parameter names differ: only in result {only_a}, only in reference {only_b}"
    for name in sorted(reference.params):
        a, b = result.params[name], reference.params[name]
        if a.shape != b.shape:
            return f"parameter {name}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}"
        if not torch.allclose(a, b, rtol=rtol, atol=atol):
            diff = (a - b).abs()
            i = int((diff - atol - rtol * b.abs()).argmax())  # the worst violation
            return (f"parameter {name}: |diff| {float(diff.flatten()[i]):.3g} at flat index {i} "
                    f"({float(a.flatten()[i])!r} vs reference {float(b.flatten()[i])!r}; "
                    f"max |diff| {float(diff.max()):.3g})")
    return None
